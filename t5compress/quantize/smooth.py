"""SmoothQuant-style scale migration for T5's linear layers, done on the exported fp32 graph.

T5 v1.1 / Flan activations have channels with outliers: an int8 scale sized for them (per tensor, or per token)
rounds every other channel coarsely. SmoothQuant divides each input channel j by s_j and multiplies row j of the
weight by s_j (the product is unchanged), with s_j = max|x_j|^alpha / max|W_j|^(1 - alpha), so activations and
weights share the difficulty. The division is folded into what produces the channel, which keeps the graph exactly
equivalent in fp32:
    after a layer norm:  (x / rms(x) * g) W     fold into the norm's weight g: q|k|v, cross q, wi (wi_0|wi_1),
                                                the LM head of an untied model; layers reading one norm share s
    relu FFN output:     wo(relu(x Wi))         relu(z) / s = relu(z / s) for s > 0: fold into Wi's columns
    gated FFN output:    wo(gelu(x Wi0) * x Wi1) the product is linear in x Wi1: fold into Wi1's columns
Left as they are: attention's `o` (its input is the value cache another graph wrote) and cross-attention k/v (their
input is the encoder's output, read by another graph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from t5compress.quantize.graphs import FFN_OUTPUT
from t5compress.runtime.sessions import load_onnx

log = logging.getLogger(__name__)

NORM, COLUMNS = "norm", "columns"  # how a group's scale is folded: into a norm weight, or a producer's weight columns


@dataclass(frozen=True)
class Group:
    """Linear layers reading one tensor (`x`), and where the division by their shared scale is folded."""

    x: str
    nodes: tuple[str, ...]
    weights: tuple[str, ...]
    fold: str  # NORM or COLUMNS
    fold_weight: str
    norm: str = ""  # NORM: the Mul node applying the norm's weight (which gets its own rescaled copy) ...
    norm_input: str = ""  # ... and its input that reads the weight (the initializer, or an Identity of it)


def smooth_groups(model: onnx.ModelProto) -> list[Group]:
    """Every group of linear layers whose input channels can be rescaled exactly (see the module docstring)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    groups = []
    for x, users in readers.items():
        linear = [u for u in users if u.op_type == "MatMul" and u.input[0] == x and u.input[1] in inits]
        norm = producer.get(x)
        if (not linear or x in outputs or norm is None or norm.op_type != "Mul"
                or any(u.op_type != "Shape" for u in users if u not in linear)
                or any(len(readers[u.input[1]]) != 1 for u in linear)):  # a weight another node shares stays
            continue
        # The exporter stores equal norm weights once, read through Identity nodes (a fresh model's ones): the
        # fold gives each norm its own copy.
        source = {i: producer[i].input[0] if i in producer and producer[i].op_type == "Identity" else i
                  for i in norm.input}
        gain = [i for i in norm.input if source[i] in inits and len(inits[source[i]].dims) == 1]
        if len(gain) == 1:
            groups.append(Group(x, tuple(u.name for u in linear), tuple(u.input[1] for u in linear), NORM,
                                source[gain[0]], norm.name, gain[0]))
    return groups + ffn_output_groups(model, readers)


def ffn_output_groups(model: onnx.ModelProto, readers: dict[str, list]) -> list[Group]:
    """Each FFN output `wo` whose input channels can be divided in the columns of `wi_1` (gated) or `wi` (relu)."""
    nodes = {n.name: n for n in model.graph.node}
    inits = {t.name for t in model.graph.initializer}
    groups = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or FFN_OUTPUT not in n.name or n.input[1] not in inits:
            continue
        prefix = n.name[: n.name.index(FFN_OUTPUT)] + "DenseReluDense/"
        fold = nodes.get(prefix + "wi_1/MatMul") or nodes.get(prefix + "wi/MatMul")
        if (fold is None or fold.input[1] not in inits or len(readers.get(fold.input[1], [])) != 1
                or len(readers[n.input[1]]) != 1):
            log.info("smoothing: %s has no foldable producer; left as is", n.name)
            continue
        groups.append(Group(n.input[0], (n.name,), (n.input[1],), COLUMNS, fold.input[1]))
    return groups


class ChannelMax:
    """Per-channel max |x| of the groups' inputs over real runs (a calibration statistic, see `calibrate.TapGraph`)."""

    def __init__(self, groups: list[Group]):
        self.inputs = list(dict.fromkeys(g.x for g in groups))
        self.amax: dict[str, np.ndarray] = {}

    def augment(self, model) -> list[str]:
        return self.inputs

    def __call__(self, feeds: dict[str, np.ndarray], values: dict[str, np.ndarray]) -> None:
        for name in self.inputs:
            x = values[name]
            m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)  # (channels,)
            self.amax[name] = np.maximum(self.amax[name], m) if name in self.amax else m

    def join(self, other: ChannelMax) -> None:
        """One max for each input both measured, over the two graphs' runs (`sources.join_decoders`)."""
        for name in set(self.amax) & set(other.amax):
            self.amax[name] = other.amax[name] = np.maximum(self.amax[name], other.amax[name])


def smooth(path: Path, dst: Path, groups: list[Group], amax: dict[str, np.ndarray], alpha: float) -> dict:
    """Write the rescaled graph to `dst`; returns how many groups were rescaled and how far their scales spread."""
    model = load_onnx(str(path))
    summary = smooth_model(model, groups, amax, alpha)
    onnx.save(model, str(dst))
    return summary


def smooth_model(model: onnx.ModelProto, groups: list[Group], amax: dict[str, np.ndarray], alpha: float) -> dict:
    """`smooth` on a model in memory (rescaled in place)."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}

    def put(name: str, value: np.ndarray) -> None:
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    spread = []
    for grp in groups:
        if grp.x not in amax:
            continue
        ws = [numpy_helper.to_array(inits[w]) for w in grp.weights]  # (in, out): MatMul(x, W), input channel = row
        wmax = np.maximum(np.max([np.abs(w).max(axis=1) for w in ws], axis=0), 1e-5)
        s = np.clip(np.maximum(amax[grp.x], 1e-5) ** alpha / wmax ** (1 - alpha), 1e-5, 1e5).astype(np.float32)
        for name, w in zip(grp.weights, ws, strict=True):
            put(name, w * s[:, None])
        f = numpy_helper.to_array(inits[grp.fold_weight])  # a norm's (channels,) or a producer's (in, channels)
        if grp.fold == NORM:
            own = grp.norm + "/smoothed_weight"
            model.graph.initializer.append(numpy_helper.from_array((f / s).astype(np.float32), own))
            mul = nodes[grp.norm]
            mul.input[list(mul.input).index(grp.norm_input)] = own
        else:
            put(grp.fold_weight, f / s[None, :])
        spread.append(float(s.max() / s.min()))
    read = {i for n in model.graph.node for i in n.input}
    for t in [t for t in model.graph.initializer if t.name not in read]:  # norm weights every norm now has a copy of
        model.graph.initializer.remove(t)
    return {"alpha": alpha, "groups": len(spread), "layers": sum(len(g.nodes) for g in groups if g.x in amax),
            "max_scale_ratio": round(max(spread), 2) if spread else None}
