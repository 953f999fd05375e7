"""Check exported graphs against the PyTorch model they came from: logits and cache per graph, then greedy tokens.

Each graph is checked on its own: it gets its inputs from PyTorch (encoder output, cache of the prefix) and its
outputs are compared with a plain full forward of `T5ForConditionalGeneration`, on several batch sizes and lengths
with padded rows. Then the package's runtime (`t5compress.runtime`, what users generate with) drives the exported
graphs end to end and must reproduce `model.generate` token for token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from t5compress.errors import ExportError
from t5compress.export.graphs import GraphSpec, flatten_cache
from t5compress.names import (
    DECODER,
    DECODER_MASK,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    ONNX_SUFFIX,
    TORCHSCRIPT_SUFFIX,
    past_names,
    present_names,
)
from t5compress.runtime.sessions import Graph

log = logging.getLogger(__name__)

# (batch, encoder length, decoder length): batch 1 and odd lengths, rows padded to different lengths.
CASES: tuple[tuple[int, int, int], ...] = ((1, 4, 2), (2, 9, 3), (3, 13, 6))
# Tolerance per output tensor: |export - PyTorch| <= atol + rtol * max|PyTorch tensor|. fp32 rounding grows with the
# values (Flan-T5's logits reach ~100, where 1e-4 absolute is a relative 1e-6: a few float32 ulps), so the
# allowance scales with each tensor; atol covers tensors near zero.
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-5


def open_onnx(out: Path, names: list[str]) -> dict[str, Graph]:
    """The runtime's own ONNX Runtime graphs (CPU, this process's torch thread count) for `names`."""
    from t5compress.runtime.sessions import OnnxGraph

    return {n: OnnxGraph(out / f"{n}{ONNX_SUFFIX}", torch.get_num_threads()) for n in names}


def open_torchscript(out: Path, specs: dict[str, GraphSpec]) -> dict[str, Graph]:
    """The runtime's own TorchScript graphs, called positionally in the declared input order."""
    from t5compress.export.torchscript import quiet_jit
    from t5compress.runtime.sessions import TorchScriptGraph

    with quiet_jit():
        return {n: TorchScriptGraph(out / f"{n}{TORCHSCRIPT_SUFFIX}", s.inputs, s.outputs) for n, s in specs.items()}


def make_batch(vocab: int, batch: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random ids (batch, length) right-padded with 0 to random row lengths (the first row is full); and the mask."""
    lengths = np.concatenate([[length], rng.integers(1, length + 1, batch - 1)])
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)  # (batch, length)
    ids = rng.integers(3, vocab, (batch, length)) * mask  # pad id 0 where masked
    return ids.astype(np.int64), mask


def _fresh_cache():
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    # Config-less: a cache sized from the config takes the encoder depth, wrong when decoder depth differs.
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def _named(values: tuple[torch.Tensor, ...], names: list[str]) -> dict[str, np.ndarray]:
    return {n: v.numpy() for n, v in zip(names, values, strict=True)}


def _errors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> Iterator[tuple[str, float, float]]:
    """(output name, max |got - want|, max |want|) per output named in `want`; NaN or a wrong shape is infinite."""
    for name, ref in want.items():
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        if got[name].shape != ref.shape:
            yield name, math.inf, scale
            continue
        d = float(np.abs(got[name].astype(np.float64) - ref).max()) if ref.size else 0.0
        yield name, (d if not math.isnan(d) else math.inf), scale


def _comparisons(model, graphs: dict[str, Graph], seed: int) -> Iterator[tuple[str, dict, dict]]:
    """(graph name, its outputs, PyTorch's outputs) for every graph in `graphs` and every case in `CASES`."""
    cfg, layers = model.config, model.config.num_decoder_layers
    rng = np.random.default_rng(seed)
    for batch, enc_len, dec_len in CASES:
        ids, mask = make_batch(cfg.vocab_size, batch, enc_len, rng)
        dec = rng.integers(3, cfg.vocab_size, (batch, dec_len)).astype(np.int64)
        t_mask = torch.from_numpy(mask)
        with torch.no_grad():
            hidden = model.encoder(input_ids=torch.from_numpy(ids), attention_mask=t_mask).last_hidden_state
            full = model(encoder_outputs=(hidden,), attention_mask=t_mask, decoder_input_ids=torch.from_numpy(dec),
                         past_key_values=_fresh_cache(), use_cache=True)
            prefix = model(encoder_outputs=(hidden,), attention_mask=t_mask,
                           decoder_input_ids=torch.from_numpy(dec[:, :-1]), past_key_values=_fresh_cache(),
                           use_cache=True)
        logits = full.logits.numpy()  # (batch, dec_len, vocab)
        first_in = {"encoder_attention_mask": mask, "input_ids": dec, "encoder_hidden_states": hidden.numpy()}
        cache = flatten_cache(full.past_key_values, layers, cross=True)
        first_want = {"logits": logits, **_named(cache, present_names(layers))}
        past_in = {"encoder_attention_mask": mask, "input_ids": dec[:, -1:],
                   DECODER_MASK: np.ones((batch, dec_len), dtype=np.int64),  # in-flight layout only: all real
                   **_named(flatten_cache(prefix.past_key_values, layers, True), past_names(layers))}
        self_names = present_names(layers, cross=False)
        past_want = {"logits": logits[:, -1:], **{n: first_want[n] for n in self_names}}
        checks: dict[str, list[tuple[dict, dict]]] = {
            ENCODER: [({"input_ids": ids, "attention_mask": mask}, {"last_hidden_state": hidden.numpy()})],
            DECODER: [(first_in, first_want)],
            DECODER_WITH_PAST: [(past_in, past_want)],
            DECODER_MERGED: [
                ({**first_in, **_empty_past(past_in), "use_cache_branch": np.array([False])}, first_want),
                ({**first_in, **past_in, "use_cache_branch": np.array([True])}, past_want),
            ],
        }
        for name, graph in graphs.items():
            for feeds, want in checks[name]:
                yield name, graph.run(feeds), want
            if name == DECODER_WITH_PAST and DECODER_MASK in graph.input_names:
                yield name, left_padded_run(graph, past_in), past_want


def logits_parity(model, graphs: dict[str, Graph], seed: int = 0) -> dict[str, float]:
    """Max absolute difference to PyTorch per graph (over logits and cache outputs), across all `CASES`."""
    worst = dict.fromkeys(graphs, 0.0)
    for name, got, want in _comparisons(model, graphs, seed):
        for _, d, _ in _errors(got, want):
            worst[name] = max(worst[name], d)
    return worst


def tensor_parity(
    model, graphs: dict[str, Graph], atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, seed: int = 0
) -> dict[str, dict]:
    """Per graph: the worst output against the scale-aware tolerance `atol + rtol * max|reference tensor|`.

    Each output tensor (logits, every cache tensor) gets its own allowance, so large logits (e.g. ~100 in Flan-T5)
    are not held to the absolute error of small cache values. Returns, per graph, `max_abs_diff`, `max_rel_diff`
    (difference / max|reference|) and `worst`: the tensor with the highest difference / allowance ratio
    (`ratio` <= 1 passes).
    """
    out = {n: {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "worst": None} for n in graphs}
    for name, got, want in _comparisons(model, graphs, seed):
        row = out[name]
        for tensor, d, scale in _errors(got, want):
            allowed = atol + rtol * scale
            ratio = d / allowed if allowed > 0 else (0.0 if d == 0 else math.inf)
            row["max_abs_diff"] = max(row["max_abs_diff"], d)
            row["max_rel_diff"] = max(row["max_rel_diff"], d / scale if scale > 0 else (0.0 if d == 0 else math.inf))
            if row["worst"] is None or ratio > row["worst"]["ratio"]:
                row["worst"] = {"output": tensor, "abs_diff": d, "scale": scale, "allowed": allowed, "ratio": ratio}
    return out


def left_padded_run(graph: Graph, feeds: dict[str, np.ndarray], pad: int = 2) -> dict[str, np.ndarray]:
    """The in-flight layout's claim, checked: run a masked decoder_with_past_model with every row's self-attention
    cache left-padded by `pad` masked slots; its outputs, padding cut off, must equal the unpadded run's."""
    padded = dict(feeds)
    for n, v in feeds.items():
        if n.startswith("past_key_values.") and ".decoder." in n:  # (batch, heads, past_len, d_kv)
            padded[n] = np.pad(v, ((0, 0), (0, 0), (pad, 0), (0, 0)))
    mask = feeds[DECODER_MASK]  # (batch, past_len + 1)
    padded[DECODER_MASK] = np.concatenate([np.zeros((mask.shape[0], pad), dtype=mask.dtype), mask], axis=1)
    out = graph.run(padded)
    return {n: (v[:, :, pad:] if ".decoder." in n else v) for n, v in out.items()}


def _empty_past(past_in: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zero-length past tensors: what the merged decoder is fed on the first step."""
    return {n: v[:, :, :0] for n, v in past_in.items() if n.startswith("past_key_values.")}


def layouts(graphs: dict[str, Graph]) -> list[str]:
    """The decoder layouts `graphs` can generate with: 'separate' (two decoders) and/or 'merged'."""
    found = ["separate"] if DECODER in graphs and DECODER_WITH_PAST in graphs else []
    return found + (["merged"] if DECODER_MERGED in graphs else [])


def greedy(
    graphs: dict[str, Graph], ids: np.ndarray, mask: np.ndarray, start: int, eos: set[int], pad: int,
    max_new_tokens: int, decoders: str = "auto",
) -> np.ndarray:
    """Greedy decoding with the package's runtime over `graphs`: (batch, 1 + steps) ids, as model.generate.

    `decoders`: 'separate', 'merged' (decoder_model_merged, both branches), or 'auto' (separate when present).
    """
    from t5compress.runtime import Seq2SeqRuntime, SpecialTokens
    from t5compress.runtime.sessions import Backend, MergedStep

    if decoders == "auto":
        decoders = layouts(graphs)[0]
    if decoders == "merged":
        merged = graphs[DECODER_MERGED]
        backend = Backend("verify", graphs[ENCODER], MergedStep(merged, False), MergedStep(merged, True))
    else:
        backend = Backend("verify", graphs[ENCODER], graphs[DECODER], graphs[DECODER_WITH_PAST])
    runtime = Seq2SeqRuntime(".", backend, SpecialTokens(start, tuple(sorted(eos)), pad), defaults={},
                             max_input_tokens=None)
    return runtime.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=1)


def generation_parity(
    model, graphs: dict[str, Graph], max_new_tokens: int, seed: int = 0, decoders: str = "auto"
) -> dict:
    """Greedy tokens from the graphs vs `model.generate` on a padded batch: identical or not, and where."""
    from transformers import GenerationConfig

    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    batch, enc_len, _ = CASES[-1]
    ids, mask = make_batch(cfg.vocab_size, batch, enc_len, np.random.default_rng(seed + 1))
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.pad_token_id  # as HF T5
    # Plain greedy, whatever the model's generation_config asks for; dynamic_full sizes the cache per decoder
    # layer (transformers 4.57 otherwise sizes it from the encoder depth and fails when the depths differ).
    gen = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, decoder_start_token_id=start,
        eos_token_id=eos, pad_token_id=cfg.pad_token_id, cache_implementation="dynamic_full",
    )
    with torch.no_grad():
        want = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              generation_config=gen).numpy()
    got = greedy(graphs, ids, mask, start, set(eos), cfg.pad_token_id, max_new_tokens, decoders)
    same = got.shape == want.shape and bool((got == want).all())
    rows = [] if same else [i for i in range(batch) if got.shape != want.shape or (got[i] != want[i]).any()]
    return {"max_new_tokens": max_new_tokens, "batch": batch, "identical": same, "differing_rows": rows,
            "tokens": want.tolist()}


def raise_if_over(
    parity: dict[str, dict], atol: float, rtol: float, what: str, options: str = "--atol/--rtol"
) -> None:
    """A one-line ExportError naming the graph and tensor of `tensor_parity`'s result that is over its tolerance."""
    for name, p in parity.items():
        w = p["worst"]
        if not w["ratio"] <= 1.0:
            raise ExportError(
                f"{what}: {name} differs from PyTorch by {w['abs_diff']:.3g} in {w['output']} (> {w['allowed']:.3g} ="
                f" atol {atol:g} + rtol {rtol:g} x max|ref| {w['scale']:.3g}); nothing was written"
                f" (raise {options} if this precision is acceptable)"
            )


@torch.no_grad()
def token_agreement(model, graphs: dict[str, Graph], max_new_tokens: int, rows: int = 16, seed: int = 7) -> dict:
    """Greedy tokens of the graphs vs `model.generate` on random padded inputs: the share of generated tokens that
    match before each row's first difference (a token after a difference is counted as differing)."""
    from transformers import GenerationConfig

    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.pad_token_id
    ids, mask = make_batch(cfg.vocab_size, rows, 11, np.random.default_rng(seed))
    gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, decoder_start_token_id=start,
                           eos_token_id=eos, pad_token_id=cfg.pad_token_id, cache_implementation="dynamic_full")
    want = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                          generation_config=gen).numpy()
    got = greedy(graphs, ids, mask, start, set(eos), cfg.pad_token_id, max_new_tokens)
    width = max(want.shape[1], got.shape[1])
    want, got = (np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=cfg.pad_token_id) for a in (want, got))
    same = total = 0
    for w, g in zip(want[:, 1:], got[:, 1:], strict=True):
        n = int((w != cfg.pad_token_id).sum()) or 1  # generated tokens of the reference row
        diff = np.flatnonzero(w != g)
        same += min(n, int(diff[0]) if diff.size else n)
        total += n
    return {"rows": rows, "tokens": total, "agreement": round(same / total, 4),
            "identical_rows": int(sum((w == g).all() for w, g in zip(want, got, strict=True)))}


def verify(
    model, graphs: dict[str, Graph], atol: float, max_new_tokens: int, what: str, rtol: float = DEFAULT_RTOL
) -> dict:
    """Run both checks; raise a one-line ExportError naming the graph or row that failed. Returns the numbers.

    A graph passes when every output tensor is within `atol + rtol * max|reference tensor|` of PyTorch.
    """
    parity = tensor_parity(model, graphs, atol, rtol)
    raise_if_over(parity, atol, rtol, what)
    gens = {layout: generation_parity(model, graphs, max_new_tokens, decoders=layout) for layout in layouts(graphs)}
    for layout, gen in gens.items():
        if not gen["identical"]:
            raise ExportError(
                f"{what}: greedy tokens over the {layout} decoder(s) differ from model.generate in row(s) "
                f"{gen['differing_rows']}; nothing was written"
            )
    if not gens:
        raise ExportError(f"{what}: no decoder graphs to generate with ({', '.join(graphs)})")
    gen = next(iter(gens.values()))
    diffs = {k: p["max_abs_diff"] for k, p in parity.items()}
    log.info("%s: max abs diff %s, greedy identical", what, {k: f"{v:.2e}" for k, v in diffs.items()})
    return {"atol": atol, "rtol": rtol, "cases": [list(c) for c in CASES], "max_abs_diff": diffs,
            "max_rel_diff": {k: p["max_rel_diff"] for k, p in parity.items()},
            "worst": {k: p["worst"] for k, p in parity.items()}, "generation": gen,
            "generation_by_decoders": {k: g["identical"] for k, g in gens.items()}}
