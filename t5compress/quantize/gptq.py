"""GPTQ rounding of int8 weights (Frantar et al., ICLR 2023): the same int8 grid, a scale per output channel, but
each weight's rounding error is spread over the input channels not yet rounded, weighted by what the calibration
inputs make of them, so that a layer's outputs on real inputs move less than with rounding to nearest.

    grams = Gram(graph.model, node_names)         # a calibration statistic: X^T X of each node's input
    q, scale = gptq_int8(w, gram, weight_max)    # w: (in, out) as ONNX MatMul holds it

With int8 activations taken per token, what static int8 still loses on the gated fixtures is mostly the weights'
rounding: weights alone rounded to nearest (activations fp32) kept 95.5% / 76.4% of the demo / docstring fixture's
held-out greedy outputs, rounded by GPTQ 98.2% / 86.1% (benchmarks/results/current/int8_ceiling.md). With the rows int8
too, GPTQ kept 95.9% / 73.6% against 95.2% / 72.1% rounded to nearest (docs/quantize.md).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from t5compress.names import DECODER, DECODER_WITH_PAST

BLOCK = 128  # input channels rounded before the rest are updated at once (GPTQ's lazy batch update)
DAMP = 0.01  # added to the Gram matrix's diagonal, as a share of its mean: keeps it invertible


class Gram:
    """X^T X of the inputs of the MatMul nodes among `names`, summed over real runs (a calibration statistic, see
    `calibrate.TapGraph`, like `smooth.ChannelMax`): one (in, in) float32 matrix per input, whatever the runs, as
    GPTQ's reference implementation keeps it (`_inverse_factor` inverts it in float64)."""

    def __init__(self, model, names: list[str]):
        """`model`: the graph's structure (`sources.Graph.model`; its weights are not read)."""
        self.inputs = {n.name: n.input[0] for n in model.graph.node if n.name in set(names) and n.op_type == "MatMul"}
        self.tensors = list(dict.fromkeys(self.inputs.values()))
        self.key = {x: x for x in self.tensors}  # where each input's X^T X is summed (`share`)
        self.gram: dict[str, np.ndarray] = {}

    def augment(self, model) -> list[str]:
        return self.tensors

    def __call__(self, feeds: dict[str, np.ndarray], values: dict[str, np.ndarray]) -> None:
        for name in self.tensors:
            x = values[name]
            x = x.reshape(-1, x.shape[-1]).astype(np.float32, copy=False)
            key = self.key[name]
            if key in self.gram:
                self.gram[key] += x.T @ x
            else:
                self.gram[key] = x.T @ x

    def by_node(self) -> dict[str, np.ndarray]:
        return {node: self.gram[self.key[x]] for node, x in self.inputs.items() if self.key[x] in self.gram}

    def share(self, other: Gram) -> None:
        """Sum this graph's runs into `other`'s matrices from now on: for each layer both measure (the same node
        name; the decoders name a layer's input apart, e.g. the cross-attention output's), the one of `other`'s input;
        an input of this graph's alone gets its own ("past:" + name)."""
        pairs = {(x, other.inputs[node]) for node, x in self.inputs.items() if node in other.inputs}
        mine, theirs = Counter(a for a, _ in pairs), Counter(b for _, b in pairs)
        one_to_one = {a: b for a, b in pairs if mine[a] == theirs[b] == 1}  # the same layers read the two inputs
        self.key = {x: one_to_one.get(x, f"past:{x}") for x in self.tensors}
        self.gram = other.gram


def gram_meters(graphs: dict, nodes: dict[str, list[str]]) -> dict[str, Gram]:
    """A `Gram` of `nodes[g]` for each graph g (`graphs[g]`: a `sources.Graph`). The with-past graph sums its runs
    into the first decoder's matrices as they run (`Gram.share`), so a layer both hold has one X^T X, in memory
    once, and its weights are rounded once and stored once (flan-t5-large: 2.3 GiB of Grams by their shapes, 3.5
    for one per graph). The decoders' other statistics are joined after their runs (`sources.join_decoders`)."""
    meters = {g: Gram(graphs[g].model, nodes[g]) for g in nodes}
    if DECODER in meters and DECODER_WITH_PAST in meters:
        meters[DECODER_WITH_PAST].share(meters[DECODER])
    return meters


def round_graphs(graphs: dict, grams: dict[str, Gram], weight_max: int = 127,
                 step=lambda: None, group: int | None = None, limits: dict[str, int] | None = None) -> dict[str, dict]:
    """{graph: {node name: (int8 weight, scales)}}: the weights of the nodes each graph's `Gram` measured, read from
    `graphs[graph]` (a `sources.Graph`) and rounded by GPTQ on that graph's inputs (`group`: see `gptq_int8`;
    `limits`: another `weight_max` for the nodes it names, e.g. those a 4-bit model keeps 8-bit). The two decoder
    graphs' shared layers are rounded on both graphs' inputs together (`gram_meters`), so their int8
    weights are byte-identical and stored once; each is rounded once (the same weight bytes on the same X^T X, the
    same limit: the first graph's result is reused)."""
    import hashlib

    from onnx import numpy_helper

    rounded: dict[str, dict] = {}
    done: dict[tuple, tuple] = {}  # (weight's sha256, id of its X^T X, weight_max) -> (int8, scales, that X^T X)
    for g, gram in grams.items():
        model, hessians, rounded[g] = graphs[g].weights(), gram.by_node(), {}
        inits = {t.name: t for t in model.graph.initializer}
        for node in (n for n in model.graph.node if n.name in hessians):
            w, h, wmax = numpy_helper.to_array(inits[node.input[1]]), hessians[node.name], (limits or {}).get(
                node.name, weight_max)
            key = (hashlib.sha256(w.tobytes()).digest(), w.shape, id(h), wmax)  # the joined X^T X is one array
            if key not in done:
                done[key] = (*gptq_int8(w, h, wmax, group), h)  # h kept: its id stays its own
            rounded[g][node.name] = done[key][:2]
            step()
    return rounded


def gptq_int8(w: np.ndarray, gram: np.ndarray, weight_max: int = 127,
              group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w (in, out) -> (int8 (in, out), scales float32): the input channels rounded in order, each error spread over
    the later ones. Scales max |w| / weight_max, as rounding to nearest has them: per output channel, (out,); with
    `group`, per `group` input channels of each output channel, (ceil(in / group), out), each taken from the weights
    as the errors of the channels before it left them (GPTQ's groups)."""
    W = w.T.astype(np.float64)  # (out, in): a row per output channel
    n = W.shape[1]
    size, scales = group or n, []  # per output channel: one group of every input channel, scaled before any update
    U = _inverse_factor(gram)
    Q = np.empty_like(W)
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        block, errors = W[:, b0:b1].copy(), np.empty((W.shape[0], b1 - b0))
        for j in range(b1 - b0):
            i = b0 + j
            if i % size == 0:  # this group's columns as they stand now
                cols = np.concatenate([block[:, j:j + size], W[:, b1:i + size]], axis=1)
                scales.append(np.maximum(np.abs(cols).max(axis=1), 1e-12) / weight_max)
            q = np.clip(np.round(block[:, j] / scales[-1]), -weight_max, weight_max)
            Q[:, i] = q
            errors[:, j] = (block[:, j] - q * scales[-1]) / U[i, i]
            block[:, j + 1:] -= np.outer(errors[:, j], U[i, i + 1:b1])
        W[:, b1:] -= errors @ U[b0:b1, b1:]
    scale = np.stack(scales) if group else scales[0]
    return Q.T.astype(np.int8), scale.astype(np.float32)


def _inverse_factor(gram: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor of the damped Gram matrix's inverse (GPTQ's update weights). A channel no input
    reached gets a unit diagonal: its error goes nowhere, and it is rounded to nearest."""
    h = np.array(gram, dtype=np.float64)
    dead = np.diag(h) <= 0
    h[dead, :], h[:, dead] = 0, 0
    h[dead, dead] = 1
    damp = DAMP * float(np.mean(np.diag(h)))
    for _ in range(6):  # damp more until the factorisation holds
        try:
            return np.linalg.cholesky(np.linalg.inv(h + damp * np.eye(len(h)))).T
        except np.linalg.LinAlgError:
            damp *= 10
    return np.eye(len(h))  # rounding to nearest
