"""Vocabulary pruning: keep the pieces a task uses, slice the embedding and LM head, rewrite the tokenizer.

    keep = plan_vocab(tokenizer, pieces_used(tokenizer, examples))
    model, tokenizer, id_map = trim_vocab(model, tokenizer, keep)

Only a SentencePiece unigram tokenizer (tokenizer.json with a Unigram model: T5, mT5, UMT5 and those `create`
trains) can be trimmed: Viterbi segmentation picks the best-scoring pieces, so a text whose pieces are all kept is
segmented exactly as before. Every single-character piece is kept, so no text falls back to <unk> that did not
before. The new ids keep the old order, so pad, eos and unk keep their ids 0, 1, 2.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from t5compress.data import Example
from t5compress.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

SENTINEL = re.compile(r"<extra_id_\d+>")
# Files a model dir may carry for a slow tokenizer: after trimming they would describe the old vocabulary.
SLOW_TOKENIZER_FILES = ("spiece.model", "sentencepiece.bpe.model", "added_tokens.json")


def tokenizer_kind(tokenizer) -> str:
    """What kind of tokenizer this is, in words: "unigram", "byte-level (ByT5Tokenizer)", "BPE", ..."""
    if not getattr(tokenizer, "is_fast", False):
        name = type(tokenizer).__name__
        return f"byte-level ({name})" if "ByT5" in name else f"slow ({name})"
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model_type = spec["model"]["type"]
    pre = json.dumps(spec.get("pre_tokenizer") or {})
    if model_type == "BPE" and not spec["model"].get("merges") and "ByteLevel" in pre:
        return "byte-level (BPE without merges)"
    return "unigram" if model_type == "Unigram" else model_type


def check_trimmable(tokenizer) -> None:
    """Raise a one-line ModelError unless `tokenizer` is a fast unigram one whose vocabulary can be rewritten."""
    kind = tokenizer_kind(tokenizer)
    if kind.startswith("byte-level"):
        raise ModelError(f"vocabulary pruning: the tokenizer is {kind}; a byte vocabulary has nothing to trim")
    if kind != "unigram":
        raise ModelError(f"vocabulary pruning: cannot rewrite a {kind} tokenizer; only SentencePiece unigram ones "
                         "(T5, mT5, UMT5, `create --tokenizer unigram`) can be trimmed")


def task_texts(examples: Iterable[Example], prefix: str = "") -> list[str]:
    """The texts a model sees of `examples`: every `prefix + source`, then every target."""
    examples = list(examples)
    return [prefix + e.source for e in examples] + [e.target for e in examples]


def pieces_used(tokenizer, examples: Iterable[Example], prefix: str = "") -> Counter:
    """How often each id occurs when `prefix + source` and the target of every example are tokenized (eos included)."""
    counts: Counter = Counter()
    for ids in tokenizer(task_texts(examples, prefix), add_special_tokens=True)["input_ids"]:
        counts.update(ids)
    return counts


def mandatory_ids(tokenizer, *, sentinels: bool, keep_pieces: Iterable[str] = ()) -> dict[str, set[int]]:
    """The ids kept whatever the data, by reason: special tokens (sentinels aside), single characters, sentinels
    (when `sentinels`) and `keep_pieces`; a piece of `keep_pieces` the tokenizer lacks is a ConfigError."""
    vocab = tokenizer.get_vocab()
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    specials = set(tokenizer.all_special_tokens) | added
    wanted = list(keep_pieces)
    missing = [p for p in wanted if p not in vocab]
    if missing:
        shown = ", ".join(repr(p) for p in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(f"vocab_keep: {shown} not pieces of the tokenizer; list pieces as the tokenizer spells "
                          "them (e.g. '▁word')")
    return {
        "special": {vocab[t] for t in specials if t in vocab and not SENTINEL.fullmatch(t)},
        "single_char": {i for p, i in vocab.items() if len(p) == 1 and p not in specials},
        "sentinels": {i for p, i in vocab.items() if SENTINEL.fullmatch(p)} if sentinels else set(),
        "keep_file": {vocab[p] for p in wanted},
    }


def plan_vocab(tokenizer, counts: Counter, mandatory: dict[str, set[int]], size: int | None = None) -> list[int]:
    """The ids to keep, ascending: the mandatory ones plus every used one, or (with `size`) exactly `size` ids: the
    mandatory ones, then the most used, then (when the data uses fewer) the pieces the tokenizer scores highest."""
    must = set().union(*mandatory.values())
    n = len(tokenizer)
    if size is None:
        return sorted(must | {i for i in counts if i < n})
    if size < len(must):
        raise ConfigError(f"vocab_size: {size} is fewer than the {len(must)} pieces always kept (special tokens, "
                          "single characters, sentinels, --vocab-keep); give at least that many")
    if size > n:
        raise ConfigError(f"vocab_size: {size} is more than the tokenizer's {n} pieces")
    scores = _scores(tokenizer)
    rest = sorted((i for i in range(n) if i not in must), key=lambda i: (-counts.get(i, 0), -scores.get(i, 0.0), i))
    return sorted(must | set(rest[: size - len(must)]))


def _scores(tokenizer) -> dict[int, float]:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    return {i: float(score) for i, (_, score) in enumerate(spec["model"]["vocab"])}


def trim_vocab(model, tokenizer, keep_ids: Iterable[int]) -> tuple:
    """Keep only the ids `keep_ids` (old ids) in `model` (changed in place) and a new tokenizer; new ids keep the
    old order. Returns (model, tokenizer, id_map) with id_map {old id: new id} for the kept ids."""
    check_trimmable(tokenizer)
    keep = sorted(set(int(i) for i in keep_ids))
    if not keep or keep[-1] >= min(len(tokenizer), model.config.vocab_size) or keep[0] < 0:
        raise ConfigError(f"keep_ids: ids must lie in [0, {min(len(tokenizer), model.config.vocab_size)})")
    id_map = {old: new for new, old in enumerate(keep)}
    new_tokenizer = _trim_tokenizer(tokenizer, keep, id_map)
    _trim_model(model, keep, id_map)
    log.info("vocabulary: %d -> %d pieces", len(tokenizer), len(keep))
    return model, new_tokenizer, id_map


def _remap(value, id_map: dict[int, int], what: str):
    if value is None:
        return None
    if value not in id_map:
        raise ConfigError(f"keep_ids: the {what} (id {value}) must be kept")
    return id_map[value]


@torch.no_grad()
def _trim_model(model, keep: list[int], id_map: dict[int, int]) -> None:
    """Slice the shared embedding and the LM head to the rows `keep`; remap the special ids in the configs."""
    index = torch.tensor(keep, dtype=torch.long)
    old_emb, old_head = model.get_input_embeddings(), model.get_output_embeddings()
    emb = torch.nn.Embedding(len(keep), old_emb.embedding_dim, dtype=old_emb.weight.dtype,
                             device=old_emb.weight.device)
    emb.weight.copy_(old_emb.weight[index])  # (new_vocab, d_model)
    model.set_input_embeddings(emb)
    head = torch.nn.Linear(old_head.in_features, len(keep), bias=False, dtype=old_head.weight.dtype,
                           device=old_head.weight.device)
    head.weight.copy_(old_head.weight[index])  # (new_vocab, d_model); tied: the same rows as the embedding
    model.set_output_embeddings(head)
    model.config.vocab_size = len(keep)
    for cfg in (model.config, model.generation_config):
        for name in ("decoder_start_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
            value = getattr(cfg, name, None)
            if isinstance(value, list):
                setattr(cfg, name, [_remap(v, id_map, name) for v in value])
            elif value is not None:
                setattr(cfg, name, _remap(value, id_map, name))
    if model.config.tie_word_embeddings:
        model.tie_weights()


def _trim_tokenizer(tokenizer, keep: list[int], id_map: dict[int, int]):
    """The tokenizer with only the pieces `keep`, through its own files: rewrite tokenizer.json (the Unigram vocab
    list, unk_id, added tokens, the post-processor's ids), tokenizer_config.json and special_tokens_map.json, drop
    the slow tokenizer's files, and load the result with AutoTokenizer, as any user of the model dir will."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tokenizer.save_pretrained(tmp)
        for name in SLOW_TOKENIZER_FILES:
            (tmp / name).unlink(missing_ok=True)
        spec = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
        _rewrite_spec(spec, keep, id_map)
        (tmp / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        kept = {p for p, _ in spec["model"]["vocab"]} | {t["content"] for t in spec["added_tokens"]}
        _rewrite_configs(tmp, kept, id_map)
        try:
            return AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - transformers and tokenizers (Rust) raise all kinds
            raise ModelError(f"vocabulary pruning: the rewritten tokenizer does not load ({e}); "
                             "this tokenizer cannot be trimmed") from e


def _rewrite_spec(spec: dict, keep: list[int], id_map: dict[int, int]) -> None:
    model = spec["model"]
    vocab = model["vocab"]
    model["vocab"] = [vocab[i] for i in keep if i < len(vocab)]
    model["unk_id"] = _remap(model.get("unk_id"), id_map, "unk token")
    spec["added_tokens"] = [{**t, "id": id_map[t["id"]]} for t in spec["added_tokens"] if t["id"] in id_map]
    post = spec.get("post_processor") or {}
    for part in [post, *post.get("processors", [])]:
        for special in (part.get("special_tokens") or {}).values():
            special["ids"] = [_remap(i, id_map, f"special token {special['id']!r}") for i in special["ids"]]


def _rewrite_configs(tmp: Path, kept: set[str], id_map: dict[int, int]) -> None:
    """Drop removed tokens from tokenizer_config.json and special_tokens_map.json; renumber added_tokens_decoder."""
    cfg_file, map_file = tmp / "tokenizer_config.json", tmp / "special_tokens_map.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    # add_prefix_space makes T5TokenizerFast convert from spiece.model, which is gone; tokenizer.json's Metaspace
    # pre-tokenizer already carries it.
    cfg.pop("add_prefix_space", None)
    cfg["added_tokens_decoder"] = {str(id_map[int(i)]): t for i, t in cfg.get("added_tokens_decoder", {}).items()
                                   if int(i) in id_map}
    extra = [t for t in cfg.get("additional_special_tokens", []) if _content(t) in kept]
    cfg["additional_special_tokens"] = extra
    if "extra_ids" in cfg:  # T5: the number of sentinels, checked against additional_special_tokens on load
        cfg["extra_ids"] = sum(1 for t in extra if SENTINEL.fullmatch(_content(t)))
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    if map_file.is_file():
        special = json.loads(map_file.read_text(encoding="utf-8"))
        if "additional_special_tokens" in special:
            special["additional_special_tokens"] = [t for t in special["additional_special_tokens"]
                                                    if _content(t) in kept]
        map_file.write_text(json.dumps(special, indent=2, ensure_ascii=False), encoding="utf-8")


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def segmentation_changed(old, new, texts: list[str]) -> dict:
    """How many of the tokens `old` makes of `texts` `new` does not make at the same place: a token counts as
    unchanged when `new` has the same piece over the same characters."""
    before = old(texts, add_special_tokens=False, return_offsets_mapping=True)
    after = new(texts, add_special_tokens=False, return_offsets_mapping=True)
    total = changed = texts_changed = 0
    for ids_a, off_a, ids_b, off_b in zip(before["input_ids"], before["offset_mapping"], after["input_ids"],
                                          after["offset_mapping"], strict=True):
        spans = set(zip(map(tuple, off_b), new.convert_ids_to_tokens(ids_b), strict=True))
        miss = sum(s not in spans for s in zip(map(tuple, off_a), old.convert_ids_to_tokens(ids_a), strict=True))
        total, changed, texts_changed = total + len(ids_a), changed + miss, texts_changed + (miss > 0)
    return {"tokens": total, "changed": changed, "share": round(changed / total, 6) if total else 0.0,
            "texts": len(texts), "texts_changed": texts_changed}
