"""Half-precision exports: which parts stay fp32, the half model traced, and its check against the fp32 model.

fp16 holds magnitudes up to 65504. T5 v1.1 / Flan-T5's FFN output projection `wo` produces activations past that
(the reason CTranslate2's Flan-T5 fp16 gives NaN), so transformers keeps every `wo` in fp32
(`_keep_in_fp32_modules`) and so does `half_model`. What follows from that, in the traced graph, is transformers' own
code, not ours: `wo` casts its fp16 input to fp32; its fp32 output added to the fp16 residual makes the residual
stream fp32 from the first FFN on (PyTorch promotes fp16 + fp32 to fp32), so the sums that overflow are fp32; T5's
layer norm computes its variance in fp32 and hands fp16 to the next matmuls; attention, the other projections and
the LM head run in fp16. The decoder graphs cast the logits to fp32 at the end (`graphs._DecoderStep.logits`), and
the encoder output and the KV cache are fp16 tensors (half the cache memory).

ONNX Runtime 1.32's CPU provider runs these fp16 graphs (MatMul, Softmax, Add, Mul, Pow, ReduceMean, Sqrt, Div,
Cast, Gather, Where all have fp16 kernels), so they are checked here against the fp32 PyTorch model, per tensor
within `half_atol + half_rtol * max|tensor|`, and greedy decoding over them must agree with fp32 `model.generate`.
bf16 is refused: the CPU provider has bfloat16 kernels for Cast and Gather only (measured), so a bf16 graph can be
neither checked nor run here, and numpy (the runtime's array type) has no bfloat16.
"""

from __future__ import annotations

import copy
import logging

import numpy as np

from t5compress.errors import ExportError

log = logging.getLogger(__name__)

# --dtype value -> torch / numpy dtype name. fp32 is the plain export.
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
HALF_DTYPES = ("fp16", "bf16")
# Module names kept in fp32 in a half export: transformers' T5 `_keep_in_fp32_modules` (a test checks we cover it).
KEEP_FP32 = ("wo",)
BF16_REFUSED = (
    "--dtype bf16: ONNX Runtime's CPU provider has no bfloat16 kernels (only Cast and Gather), so a bf16 export can "
    "be neither checked against PyTorch nor run here, and the numpy runtime cannot hold bfloat16; use --dtype fp16 "
    "(wo, residual sums and logits kept in fp32)"
)
# Greedy tokens over a half export must agree with fp32 `model.generate` on this share of tokens (up to each row's
# first difference): fp16 rounding may flip a near-tie, a broken graph flips most tokens. Measured on the check's 16
# random rows: a random-weight flan-t5-small shape 0.93 (14 of 16 rows identical; its logits are within 0.17 of
# fp32's ~100, as PyTorch fp16's are within 0.19), t5-small 1.0; random weights make near-ties common, hence 0.8.
MIN_AGREEMENT = 0.8
_ORT_TYPES = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(double)": np.float64}


def half_model(model, dtype: str):
    """A copy of `model` in `dtype` ('fp16' or 'bf16') with every module named in `KEEP_FP32` left in fp32."""
    import torch

    half = copy.deepcopy(model).to(getattr(torch, DTYPES[dtype]))
    source = dict(model.named_modules())
    kept = 0
    for name, module in half.named_modules():
        if name.rsplit(".", 1)[-1] in KEEP_FP32:
            # The source's own fp32 values, not the half copy's cast back: a wo weight past 65504 (or finer than
            # fp16 resolves) would come back inf (or rounded).
            module.float().load_state_dict(source[name].state_dict())
            kept += 1
    log.info("%s copy of the model: %d module(s) kept in fp32 (%s)", dtype, kept, ", ".join(KEEP_FP32))
    return half.eval()


def graph_dtypes(graph) -> dict[str, str]:
    """Element type of the float inputs and outputs of an ONNX Runtime-backed graph, the cache tensors as one entry:
    e.g. {'encoder_hidden_states': 'float16', 'logits': 'float32', 'cache': 'float16'}."""
    session = graph.session
    out: dict[str, str] = {}
    for v in (*session.get_inputs(), *session.get_outputs()):
        if v.type in _ORT_TYPES:
            cache = v.name.startswith(("past_key_values.", "present."))
            out["cache" if cache else v.name] = np.dtype(_ORT_TYPES[v.type]).name
    return out


class Fp32View:
    """A half-precision graph as the fp32 comparison sees it: float feeds cast to the graph's input types, float
    outputs handed back as fp32 (the reference feeds are PyTorch fp32 tensors)."""

    def __init__(self, graph):
        self.graph, self.name = graph, graph.name
        self.input_names, self.output_names = graph.input_names, graph.output_names
        self._types = {i.name: _ORT_TYPES[i.type] for i in graph.session.get_inputs() if i.type in _ORT_TYPES}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cast = {n: v.astype(self._types[n]) if n in self._types else v for n, v in feeds.items()}
        out = self.graph.run(cast)
        return {n: v.astype(np.float32) if v.dtype.kind == "f" else v for n, v in out.items()}


def check_half(model, graphs: dict, atol: float, rtol: float, max_new_tokens: int, what: str) -> dict:
    """Half graphs against the fp32 PyTorch `model`: every output tensor within `atol + rtol * max|tensor|` (NaN or
    inf fails), greedy agreement with `model.generate` at least MIN_AGREEMENT; a one-line ExportError otherwise."""
    from t5compress.export.verify import CASES, generation_parity, raise_if_over, tensor_parity, token_agreement

    parity = tensor_parity(model, {n: Fp32View(g) for n, g in graphs.items()}, atol, rtol)
    raise_if_over(parity, atol, rtol, what, "--half-atol/--half-rtol")
    agreement = token_agreement(model, graphs, max_new_tokens)
    if agreement["agreement"] < MIN_AGREEMENT:
        raise ExportError(
            f"{what}: greedy tokens agree with the fp32 model.generate on {agreement['agreement']:.0%} of tokens "
            f"(< {MIN_AGREEMENT:.0%}); nothing was written"
        )
    gen = generation_parity(model, graphs, max_new_tokens)
    diffs = {k: p["max_abs_diff"] for k, p in parity.items()}
    log.info("%s: max abs diff %s, agreement %s", what, {k: f"{v:.2e}" for k, v in diffs.items()}, agreement)
    return {"reference": "fp32 PyTorch model", "atol": atol, "rtol": rtol, "cases": [list(c) for c in CASES],
            "max_abs_diff": diffs, "max_rel_diff": {k: p["max_rel_diff"] for k, p in parity.items()},
            "worst": {k: p["worst"] for k, p in parity.items()}, "token_agreement": agreement, "generation": gen,
            "dtypes": {n: graph_dtypes(g) for n, g in graphs.items()}}
