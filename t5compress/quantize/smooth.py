"""SmoothQuant-style scale migration for T5's FFN output projection `wo`, done on the exported fp32 graph.

T5 v1.1 / Flan activations entering `wo` have channels with huge outliers: a per-tensor int8 scale sized for them
rounds every other channel to zero. SmoothQuant divides each input channel j by s_j and multiplies row j of the
weight by s_j (the product is unchanged), with s_j = max|x_j|^alpha / max|W_j|^(1 - alpha), so activations and
weights share the difficulty. The division is folded into the layer that produces the channel, which keeps the
graph exactly equivalent:
    relu FFN:   wo(relu(x Wi))          relu(z) / s = relu(z / s) for s > 0: fold into Wi's columns
    gated FFN:  wo(gelu(x Wi0) * x Wi1) the product is linear in x Wi1: fold into Wi1's columns
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from t5compress.quantize.graphs import FFN_OUTPUT
from t5compress.runtime.sessions import load_onnx, onnx_session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pair:
    """One FFN: the `wo` MatMul, its input tensor, and the MatMul whose weight columns absorb the scale."""

    wo: str
    wo_input: str
    wo_weight: str
    fold: str
    fold_weight: str


def ffn_pairs(model: onnx.ModelProto) -> list[Pair]:
    """Every FFN whose `wo` input channels can be rescaled exactly (see the module docstring)."""
    nodes = {n.name: n for n in model.graph.node}
    inits = {t.name for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for x in n.input:
            uses[x] = uses.get(x, 0) + 1
    pairs = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or FFN_OUTPUT not in n.name or n.input[1] not in inits:
            continue
        prefix = n.name[: n.name.index(FFN_OUTPUT)] + "DenseReluDense/"
        fold = nodes.get(prefix + "wi_1/MatMul") or nodes.get(prefix + "wi/MatMul")
        if fold is None or fold.input[1] not in inits or uses.get(fold.input[1], 0) != 1 or uses[n.input[1]] != 1:
            log.info("smoothing: %s has no foldable producer; left as is", n.name)
            continue
        pairs.append(Pair(n.name, n.input[0], n.input[1], fold.name, fold.input[1]))
    return pairs


class ChannelMax:
    """Per-channel max |x| of the `wo` inputs, collected from real feeds through an augmented ONNX Runtime session."""

    def __init__(self, path: Path, pairs: list[Pair], work: Path):

        model = load_onnx(str(path))
        known = {o.name for o in model.graph.output}
        for p in pairs:
            if p.wo_input not in known:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(p.wo_input))
        aug = work / f"{path.stem}.channels.onnx"
        onnx.save(model, str(aug))
        self.session = onnx_session(aug)
        self.pairs = pairs
        self.amax: dict[str, np.ndarray] = {}

    def __call__(self, feeds: dict[str, np.ndarray]) -> None:
        names = [p.wo_input for p in self.pairs]
        for name, x in zip(names, self.session.run(names, feeds), strict=True):
            m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)  # (d_ff,)
            self.amax[name] = np.maximum(self.amax[name], m) if name in self.amax else m


def smooth(path: Path, dst: Path, pairs: list[Pair], amax: dict[str, np.ndarray], alpha: float) -> dict:
    """Write the rescaled graph to `dst`; returns how far the scales spread (for the report)."""
    model = load_onnx(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    spread = []
    for p in pairs:
        if p.wo_input not in amax:
            continue
        w = numpy_helper.to_array(inits[p.wo_weight])  # (d_ff, d_model): MatMul(x, W), input channel = row
        f = numpy_helper.to_array(inits[p.fold_weight])  # (d_model, d_ff): output channel = column
        a = np.maximum(amax[p.wo_input], 1e-5)
        wmax = np.maximum(np.abs(w).max(axis=1), 1e-5)
        s = np.clip(a**alpha / wmax ** (1 - alpha), 1e-5, 1e5).astype(np.float32)  # (d_ff,)
        inits[p.wo_weight].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(w.dtype), p.wo_weight))
        inits[p.fold_weight].CopyFrom(numpy_helper.from_array((f / s[None, :]).astype(f.dtype), p.fold_weight))
        spread.append(float(s.max() / s.min()))
    onnx.save(model, str(dst))
    return {"alpha": alpha, "layers": len(spread), "max_scale_ratio": round(max(spread), 2) if spread else None}
