"""Generation settings and special tokens, resolved the way `transformers` resolves them from an export dir.

Pure Python on purpose (the runtime must not import transformers): the defaults mirror `GenerationConfig` so that a
call with the same arguments gives the same tokens as `model.generate(...)`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t5compress.errors import ConfigError, ModelError

HF_DEFAULT_MAX_LENGTH = 20  # transformers' GenerationConfig().max_length


@dataclass(frozen=True)
class SpecialTokens:
    decoder_start: int
    eos: tuple[int, ...]
    pad: int


@dataclass(frozen=True)
class GenerationSettings:
    """Greedy or beam search settings; names and meanings follow `transformers.GenerationConfig`. Each is an
    optional input of the served text model, in this order within each type (`runtime.contract`)."""

    max_new_tokens: int = HF_DEFAULT_MAX_LENGTH
    min_new_tokens: int = 0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.min_new_tokens >= 0, "min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        _check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"{self.min_new_tokens} is more than max_new_tokens ({self.max_new_tokens}): no output satisfies both")
        _check(self.num_beams >= 1, "num_beams", f"must be >= 1, got {self.num_beams}")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               f"must be true, false or 'never', got {self.early_stopping!r}")
        _check(self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size",
               f"must be >= 0, got {self.no_repeat_ngram_size}")
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(1 <= self.num_return_sequences <= self.num_beams, "num_return_sequences",
               f"must be between 1 and num_beams ({self.num_beams}), got {self.num_return_sequences}")

    @property
    def max_length(self) -> int:
        """Longest output, decoder start token included."""
        return 1 + self.max_new_tokens

    @property
    def min_length(self) -> int:
        """Shortest output (start token included) before EOS may be chosen."""
        return 1 + self.min_new_tokens


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {message}")


_FIELDS = {f.name for f in dataclasses.fields(GenerationSettings)}


def read_generation_defaults(path: Path) -> tuple[SpecialTokens, dict[str, Any]]:
    """Special tokens and default settings from `generation_config.json`, falling back to `config.json`."""
    config = _read_json(path / "config.json")
    gen = _read_json(path / "generation_config.json")
    if not config and not gen:
        raise ModelError(f"'{path}' has neither config.json nor generation_config.json: special token ids unknown")

    def pick(key: str) -> Any:
        return gen[key] if gen.get(key) is not None else config.get(key)

    start, eos, pad = pick("decoder_start_token_id"), pick("eos_token_id"), pick("pad_token_id")
    if start is None:
        raise ModelError(f"'{path}' sets no decoder_start_token_id in generation_config.json or config.json")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if pad is None:  # transformers falls back to the (first) EOS id
        pad = eos_ids[0] if eos_ids else 0
    return SpecialTokens(int(start), tuple(int(e) for e in eos_ids), int(pad)), _defaults_from(gen)


def _defaults_from(gen: dict[str, Any]) -> dict[str, Any]:
    """Translate a generation_config into GenerationSettings fields (max_length counts the start token)."""
    out = {k: gen[k] for k in _FIELDS if gen.get(k) is not None}
    max_length = gen.get("max_length")
    if "max_new_tokens" not in out and max_length is not None and max_length != HF_DEFAULT_MAX_LENGTH:
        # transformers adds the decoder prompt (1 token) only to the library default of 20.
        out["max_new_tokens"] = max(int(max_length) - 1, 1)
    if "min_new_tokens" not in out and gen.get("min_length"):
        out["min_new_tokens"] = max(int(gen["min_length"]) - 1, 0)
    return out


def resolve(defaults: dict[str, Any], overrides: dict[str, Any]) -> GenerationSettings:
    """Settings from the export dir's defaults, with the caller's non-None values on top."""
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(_FIELDS))}")
    merged = {**defaults, **{k: v for k, v in overrides.items() if v is not None}}
    return GenerationSettings(**merged)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ModelError(f"'{path}' is not valid JSON: {e}") from None
