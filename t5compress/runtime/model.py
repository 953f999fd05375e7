"""`Seq2SeqRuntime`: tokenizer + exported graphs + search, i.e. text in, text out, without torch or transformers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from t5compress.errors import ConfigError, DataError, ModelError
from t5compress.names import DECODER_MASK
from t5compress.runtime import hugepages
from t5compress.runtime.ingraph import SEARCHES, GraphSearch
from t5compress.runtime.limits import ModelShape, check_fits
from t5compress.runtime.search import beam_search, greedy_search
from t5compress.runtime.sessions import Backend, open_backend, releases_working_memory
from t5compress.runtime.settings import GenerationSettings, SpecialTokens, read_generation_defaults, resolve
from t5compress.runtime.sharedkv import SharedCacheDecoder, is_shared, rewritten
from t5compress.runtime.text import TOKENIZER_FILE, Encoded, encode_batch, input_limit, load_text_tokenizer

log = logging.getLogger(__name__)

_FROM_DIR = object()  # max_input_tokens not given: the export dir's tokenizer_config.json decides


@dataclass(frozen=True)
class TextResult:
    """What one input text gave: its outputs (num_return_sequences of them, best first) and what was read of it."""

    outputs: list[str]
    input_tokens: int  # tokens the input had, EOS included, before truncation
    truncated: bool  # True: only the first `max_input_tokens` of them reached the model


class CachedDecoder:
    """Runs `decoder_model` for the first step and `decoder_with_past_model` after it, holding the KV cache.

    The first step runs once per input and is then repeated for each beam (all beams start from the same token).
    The cross-attention keys/values depend only on the encoder output, so they are computed in that first step and
    fed unchanged every later step; beam reordering never touches them, since all beams of an input share them.
    Only the self-attention cache is gathered by beam index.
    """

    def __init__(self, backend: Backend, hidden: np.ndarray, mask: np.ndarray, beams: int):
        self.backend, self.beams = backend, beams
        self.hidden: np.ndarray | None = hidden  # (batch, enc_len, d_model)
        self.mask = mask  # (batch, enc_len)
        self.self_cache: dict[str, np.ndarray] = {}  # (batch*beams, heads, past_len, d_kv) per name
        self.cross_cache: dict[str, np.ndarray] = {}  # (batch*beams, heads, enc_len, d_kv) per name, set once

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch*beams,) int64 -> logits (batch*beams, vocab) float32."""
        if not self.self_cache:
            return self._first(tokens[:: self.beams])
        feeds = {"input_ids": tokens[:, None], "encoder_attention_mask": self.mask}
        if DECODER_MASK in self.backend.decoder_with_past.input_names:  # in-flight layout: every slot is a token
            past_len = next(iter(self.self_cache.values())).shape[2]
            feeds[DECODER_MASK] = np.ones((tokens.shape[0], past_len + 1), dtype=np.int64)
        feeds.update(_as_past(self.self_cache))
        feeds.update(_as_past(self.cross_cache))
        out = self.backend.decoder_with_past.run(feeds)
        self.self_cache = {n: v for n, v in out.items() if ".decoder." in n}
        return out["logits"][:, -1, :].astype(np.float32, copy=False)  # fp16 exports: score in fp32 as transformers

    def _first(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch,) -> logits (batch*beams, vocab); fills both caches, expanded to batch*beams rows."""
        out = self.backend.decoder.run(
            {"input_ids": tokens[:, None], "encoder_hidden_states": self.hidden, "encoder_attention_mask": self.mask}
        )
        expand = (lambda a: np.repeat(a, self.beams, axis=0)) if self.beams > 1 else (lambda a: a)
        self.self_cache = {n: expand(v) for n, v in out.items() if ".decoder." in n}
        self.cross_cache = {n: expand(v) for n, v in out.items() if ".encoder." in n}
        if not self.self_cache or not self.cross_cache:
            raise ModelError(f"graph '{self.backend.decoder.name}' returns no present.*.decoder/encoder cache outputs")
        self.mask = expand(self.mask)
        self.hidden = None  # only the first step reads it; the cross-attention cache replaces it
        return expand(out["logits"][:, -1, :].astype(np.float32, copy=False))

    def reorder(self, rows: np.ndarray) -> None:
        """rows: (batch*beams,) new parent of each beam, always a beam of the same input."""
        moved = np.flatnonzero(rows != np.arange(rows.shape[0]))
        if moved.size:  # copy only the beams whose parent changed; the cache arrays are ours (fresh graph outputs)
            src = rows[moved]
            for v in self.self_cache.values():
                v[moved] = v[src]  # numpy gathers the right-hand side first, so overlapping rows are safe

    def keep(self, rows: np.ndarray) -> None:
        """rows: (kept,) rows to go on with; every per-row tensor shrinks (a copy per finishing step, not per step)."""
        self.self_cache = {n: np.take(v, rows, axis=0) for n, v in self.self_cache.items()}
        self.cross_cache = {n: np.take(v, rows, axis=0) for n, v in self.cross_cache.items()}
        self.mask = np.take(self.mask, rows, axis=0)


def _as_past(cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n.replace("present.", "past_key_values.", 1): v for n, v in cache.items()}


class Seq2SeqRuntime:
    """Generation on an export directory: `generate` on token ids, `generate_text` on strings."""

    def __init__(
        self, path: str | Path, backend: Backend | None, tokens: SpecialTokens, defaults: dict[str, Any],
        max_input_tokens: int | None | object = _FROM_DIR, shape: ModelShape | None = None,
    ):
        """`max_input_tokens`: longest input in tokens (None or 0: no limit); by default the dir's
        tokenizer_config.json `model_max_length` (which an export sets to the length the model was trained with).
        `shape`: the model's sizes, for the memory check before each call (None: no check). `backend` None: the
        runtime generates through `graph_search` alone (set after construction; see `load_runtime`'s search)."""
        self.path = Path(path)
        self.shape = shape
        self.backend = backend
        self.tokens = tokens
        self.defaults = defaults  # GenerationSettings fields found in generation_config.json
        self.max_input_tokens = input_limit(self.path) if max_input_tokens is _FROM_DIR else (max_input_tokens or None)
        self.device = "cpu"  # where the graphs run ('cpu' or 'cuda:N'); load_runtime sets it from the sessions
        self.io_binding = False  # True: the KV cache stays on the device between steps (runtime.binding)
        self.hugepage_bytes = 0  # weights load_runtime moved onto 2 MiB pages (runtime.hugepages)
        self.graph_search: GraphSearch | None = None  # set: the search runs inside generator.onnx (runtime.ingraph)
        self._tokenizer = None

    @property
    def format(self) -> str:
        return self.backend.format if self.backend is not None else "onnx"

    def settings(self, **overrides: Any) -> GenerationSettings:
        """The effective settings: generation_config.json defaults with the given non-None values on top."""
        return resolve(self.defaults, overrides)

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        num_beams: int | None = None,
        length_penalty: float | None = None,
        early_stopping: bool | str | None = None,
        no_repeat_ngram_size: int | None = None,
        repetition_penalty: float | None = None,
        num_return_sequences: int | None = None,
    ) -> np.ndarray:
        """Token ids like `transformers` `model.generate(...)`: (batch * num_return_sequences, out_len) int64.

        Settings left at None come from the export dir's generation_config.json (then transformers' defaults);
        they mean what they mean in `transformers.GenerationConfig`.

        Args:
            input_ids: (batch, len) int64 encoder input, right-padded with the pad id.
            attention_mask: (batch, len) 1 for real tokens; None derives it from padding, as transformers does.
        Returns:
            The decoder start token first, then the generated tokens; rows that end early are padded (greedy: with
            the pad id; beam search: with transformers' fill value, the pad id unless it is 0, else the EOS id).
        """
        gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams,
                   length_penalty=length_penalty, early_stopping=early_stopping,
                   no_repeat_ngram_size=no_repeat_ngram_size, repetition_penalty=repetition_penalty,
                   num_return_sequences=num_return_sequences)
        s = self.settings(**gen)
        input_ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
        if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise DataError(f"input_ids must be a non-empty (batch, length) array, got shape {input_ids.shape}")
        check_fits(self.shape, input_ids.shape[0], s.num_beams, input_ids.shape[1], s.max_new_tokens)
        mask = self._mask(input_ids, attention_mask)
        if self.graph_search is not None:
            return self.graph_search.generate(input_ids, mask, s, self.tokens)
        release = self.device == "cpu" and releases_working_memory()  # (`sessions.releasing`)
        try:
            return self._search(input_ids, mask, s, release)
        finally:  # the call's arrays are freed by now: what they and the once-per-call graphs freed goes back
            if release:
                hugepages.trim_heap()

    def _search(self, input_ids: np.ndarray, mask: np.ndarray, s: GenerationSettings, release: bool) -> np.ndarray:
        hidden = self.backend.encoder.run({"input_ids": input_ids, "attention_mask": mask})["last_hidden_state"]
        decoder = self.decoder_for(hidden, mask, s.num_beams, s.max_length)
        search = beam_search if s.num_beams > 1 else greedy_search
        try:
            return search(decoder, input_ids.shape[0], s, self.tokens)
        finally:  # a shared-cache decoder gives its buffers back: for the next call, or with this one (`release`)
            getattr(decoder, "close", lambda keep: None)(keep=not release)

    def decoder_for(self, hidden: np.ndarray, mask: np.ndarray, beams: int, max_length: int):
        """The step-by-step decoder of one call: the cache as numpy arrays, in buffers written in place (a shared-
        cache with-past graph, see `runtime.sharedkv`), or (io_binding) as OrtValues kept on the sessions' device."""
        if self.io_binding:
            from t5compress.runtime.binding import BoundDecoder

            return BoundDecoder(self.backend, hidden, mask, beams, self.device)
        if is_shared(self.backend.decoder_with_past):
            return SharedCacheDecoder(self.backend, hidden, mask, beams, max_length)
        return CachedDecoder(self.backend, hidden, mask, beams)

    def _mask(self, input_ids: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        if attention_mask is not None:
            mask = np.ascontiguousarray(np.asarray(attention_mask, dtype=np.int64))
            if mask.shape != input_ids.shape:
                raise DataError(f"attention_mask shape {mask.shape} differs from input_ids shape {input_ids.shape}")
            return mask
        # transformers infers the mask from padding only when the pad id occurs and is not an EOS id
        if self.tokens.pad not in self.tokens.eos and (input_ids == self.tokens.pad).any():
            return (input_ids != self.tokens.pad).astype(np.int64)
        return np.ones_like(input_ids)

    @property
    def tokenizer(self):
        """The export dir's text tokenizer: its `tokenizer.json`, or ByT5's bytes (see `runtime.text`)."""
        if self._tokenizer is None:
            self._tokenizer = load_text_tokenizer(self.path)
        return self._tokenizer

    def tokenize(self, texts: Sequence[str], max_input_tokens: int | None = None) -> Encoded:
        """Token ids, mask, and which inputs were truncated (to `max_input_tokens`, default the runtime's limit)."""
        limit = self.max_input_tokens if max_input_tokens is None else max_input_tokens
        enc = encode_batch(self.tokenizer, list(texts), limit, self.tokens.pad, self.tokens.eos)
        cut = [i for i, t in enumerate(enc.truncated) if t]
        if cut:
            log.info("%d input(s) truncated to %d tokens: rows %s", len(cut), enc.limit, cut[:10])
        return enc

    def encode(self, texts: Sequence[str], max_input_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), both (batch, longest) int64, right-padded, truncated as `tokenize`."""
        enc = self.tokenize(texts, max_input_tokens)
        return enc.input_ids, enc.attention_mask

    def decode(self, ids: np.ndarray) -> list[str]:
        return self.tokenizer.decode([row.tolist() for row in ids])

    def generate_text(self, texts: Sequence[str], **gen: Any) -> list[str]:
        """Generate for each text; with num_return_sequences = n, n strings per text, best first."""
        return [o for r in self.generate_results(texts, **gen) for o in r.outputs]

    def generate_results(
        self, texts: Sequence[str], max_input_tokens: int | None = None, **gen: Any
    ) -> list[TextResult]:
        """Generate for each text, saying per input how many tokens it had and whether it was truncated."""
        enc = self.tokenize(texts, max_input_tokens)
        decoded = self.decode(self.generate(enc.input_ids, enc.attention_mask, **gen))
        n = len(decoded) // len(enc.lengths)
        return [TextResult(decoded[i * n:(i + 1) * n], length, cut)
                for i, (length, cut) in enumerate(zip(enc.lengths, enc.truncated, strict=True))]


def load_tokenizer(path: Path, pad_id: int):
    """The dir's tokenizer.json as a padding `tokenizers.Tokenizer` (the runtime itself uses `runtime.text`)."""
    from tokenizers import Tokenizer

    file = path / TOKENIZER_FILE
    if not file.is_file():
        raise ModelError(f"'{path}' has no {TOKENIZER_FILE}: text generation needs it (token ids work without)")
    tok = Tokenizer.from_file(str(file))
    pad_token = tok.id_to_token(pad_id) or "<pad>"
    tok.enable_padding(pad_id=pad_id, pad_token=pad_token)
    tok.no_truncation()
    return tok


def load_runtime(
    path: str | Path, threads: int = 1, providers: Sequence[str] | None = None, decoders: str = "auto",
    max_input_tokens: int | None | object = _FROM_DIR, device: str = "cpu", io_binding: bool | None = None,
    search: str = "python",
) -> Seq2SeqRuntime:
    """Open an ONNX or TorchScript export directory for generation.

    Args:
        path: export directory (encoder_model, decoder_model, decoder_with_past_model + config files; or
            encoder_model and decoder_model_merged alone).
        threads: intra-op threads per graph (0: the backend's default; see `runtime.threads`).
        providers: ONNX Runtime execution providers (default: CPU).
        decoders: 'separate', 'merged' or 'auto' (the separate decoders when the dir has them, else the merged one).
        max_input_tokens: longest input in tokens, longer ones are truncated (None or 0: no limit); default: the
            dir's tokenizer_config.json `model_max_length`.
        device: 'cpu', 'cuda', 'cuda:N' or 'auto' (see `runtime.device`); ignored when `providers` is given.
        io_binding: keep the KV cache on the device between steps (ONNX, separate decoders; see `runtime.binding`);
            None: on when the graphs run on CUDA and the dir has the separate decoders, else off.
        search: 'python' (the search loop in numpy, every option) or 'graph' (the dir's generator.onnx runs the
            whole search in ONNX Runtime; see `runtime.ingraph`).
    """
    p = Path(path)
    if search not in SEARCHES:
        raise ConfigError(f"--search {search!r}: choose one of {', '.join(SEARCHES)}")
    # Rewritten before the memory regions are noted, and dropped before the new ones are collapsed (see
    # runtime.sharedkv.Rewritten).
    cpu = device == "cpu" and providers is None and not io_binding
    shared = rewritten(p) if cpu and search != "graph" and decoders != "merged" else None
    before = hugepages.regions()  # the sessions' weights are what appears from here on
    if search == "graph":
        rt = _graph_runtime(p, threads, providers, max_input_tokens, device, io_binding)
        rt.hugepage_bytes = hugepages.collapse_new(before)
        return rt
    backend, placed = open_on_device(p, threads, providers, decoders, device, shared_cache=shared)
    from t5compress.runtime.binding import bindable

    if io_binding is None:  # on a GPU the cache would otherwise cross to the host and back every step
        io_binding = placed.startswith("cuda") and bindable(backend)
    if io_binding and not bindable(backend):
        raise ModelError(f"--io-binding: '{p}' opened as {backend.format} with "
                         f"{'merged' if backend.format == 'onnx' else 'TorchScript'} decoders; IO binding runs the "
                         "separate ONNX decoder graphs (--decoders separate)")
    tokens, defaults = read_generation_defaults(p)
    rt = Seq2SeqRuntime(p, backend, tokens, defaults, max_input_tokens, ModelShape.read(p))
    rt.device, rt.io_binding = placed, io_binding
    del shared
    hugepages.trim_heap()  # what opening the sessions freed (their weights' copies before packing) back to the system
    rt.hugepage_bytes = hugepages.collapse_new(before) if placed == "cpu" else 0
    return rt


def runtime_over(path: str | Path, backend: Backend) -> Seq2SeqRuntime:
    """A runtime over graphs the caller opened (e.g. calibration's augmented ones), with the export dir's tokens,
    generation defaults, input limit and memory check."""
    p = Path(path)
    tokens, defaults = read_generation_defaults(p)
    return Seq2SeqRuntime(p, backend, tokens, defaults, shape=ModelShape.read(p))


def _graph_runtime(path: Path, threads: int, providers: Sequence[str] | None, max_input_tokens, device: str,
                   io_binding: bool | None) -> Seq2SeqRuntime:
    """A runtime whose `generate` is one call of generator.onnx; the three graphs are not opened."""
    from t5compress.runtime.device import parse_device, providers_for

    if io_binding:
        raise ConfigError("--search graph runs the whole search inside ONNX Runtime; --io-binding applies to "
                          "--search python")
    graph = GraphSearch.open(path, threads, providers or providers_for(parse_device(device)))
    tokens, defaults = read_generation_defaults(path)
    rt = Seq2SeqRuntime(path, None, tokens, defaults, max_input_tokens, ModelShape.read(path))
    rt.graph_search = graph
    return rt


def open_on_device(
    path: Path, threads: int, providers: Sequence[str] | None, decoders: str, device: str, shared_cache=None
) -> tuple[Backend, str]:
    """The backend on `device` and the device it really runs on ('cpu' or 'cuda:N'): CUDA asked for and not started
    is a one-line ModelError, never a silent CPU run (`auto` alone may fall back). `shared_cache`: see
    `sessions.open_onnx` (on the CPU only)."""
    from t5compress.runtime.device import check_session, describe, parse_device, providers_for
    from t5compress.runtime.sessions import detect_format

    wanted = parse_device(device)
    if providers is None:
        if wanted.kind != "cpu" and detect_format(path) == "torchscript":
            if wanted.kind == "cuda":
                raise ModelError(f"--device {wanted.name}: '{path}' is a TorchScript export, which this runtime runs "
                                 "on the CPU only; export ONNX for CUDA")
            return open_backend(path, threads, None, decoders), "cpu"
        providers = providers_for(wanted)
    else:
        wanted = parse_device(describe(providers))
    backend = open_backend(path, threads, providers, decoders, shared_cache)
    if backend.format != "onnx":
        return backend, "cpu"
    placed = check_session(backend.encoder.session, wanted, path)
    if wanted.kind == "auto":
        log.info("device auto: %s runs on %s", path, placed)
    return backend, placed
