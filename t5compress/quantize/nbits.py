"""4-bit weights in ONNX Runtime's block formats: MatMulNBits matrices (two weights a byte) and the embedding
lookups that read them (`GatherBlockQuantized`, which unpacks only the rows it gathers).

Weights are symmetric, -7..7 times a scale per block of input channels, stored + 8 (the ops' default zero point for
4 bits, so no zero points are written); 8-bit weights are -127..127 stored + 128 (`methods.pack_blocks`).
"""

from __future__ import annotations

import numpy as np

WEIGHT_MAX = {8: 127, 4: 7}  # symmetric grid of each width: -max..max times the block's scale
ZERO = {8: 128, 4: 8}  # MatMulNBits' and GatherBlockQuantized's default zero points


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 along the last axis (even length) -> half as many bytes, the even element in the low nibble."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_blocks4(q: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int (in, out) in -7..7 and scales (blocks, out) -> MatMulNBits' B (out, blocks, block / 2) uint8, each value + 8
    in a nibble, zero-padded past `in`, and its scales (out * blocks,) float32."""
    blocks = scales.shape[0]
    padded = np.full((blocks * block, q.shape[1]), ZERO[4], np.int16)
    padded[: q.shape[0]] = q.astype(np.int16) + ZERO[4]
    packed = pack_nibbles(padded.T.reshape(q.shape[1], blocks, block))
    return packed, np.ascontiguousarray(scales.T, dtype=np.float32).reshape(-1)


def lookup_packed4(model, name: str, p: str, k: int, block: int) -> None:
    """Make the tied lookup `name` (a Gather along axis 1 of the (d_model, vocab) LM head matrix) read the LM head's
    4-bit MatMulNBits matrix (`p`w: (vocab, blocks, block / 2), `p`scales: (vocab * blocks,)) through
    GatherBlockQuantized: the rows of the ids, unpacked and scaled, in the (d_model, batch, length) layout the Gather
    gave. The tied table is then stored once, in 4 bits."""
    from onnx import helper, numpy_helper

    node = next(n for n in model.graph.node if n.name == name)
    ids, out = node.input[1], node.output[0]  # its copy of the table, read by nothing now, goes with the unread ones
    q, blocks = f"{name}_q4", -(-k // block)
    constants = {"_scale_shape": np.array([-1, blocks, 1], np.int64), "_flat": np.array([0, 0, -1], np.int64),
                 "_start": np.array([0], np.int64), "_k": np.array([k], np.int64), "_axis": np.array([2], np.int64)}
    model.graph.initializer.extend(numpy_helper.from_array(v, q + key) for key, v in constants.items())
    model.graph.node.remove(node)
    model.graph.node.extend([
        helper.make_node("Reshape", [p + "scales", q + "_scale_shape"], [q + "_scales"], name=q + "_scales_Reshape"),
        helper.make_node("GatherBlockQuantized", [p + "w", ids, q + "_scales"], [q + "_rows"], name=q + "_Gather",
                         domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=block, bits=4),
        helper.make_node("Reshape", [q + "_rows", q + "_flat"], [q + "_padded"], name=q + "_Reshape"),  # (b, l, K')
        helper.make_node("Slice", [q + "_padded", q + "_start", q + "_k", q + "_axis"], [q + "_rows_d"],
                         name=q + "_Slice"),  # blocks of the last one past d_model are padding
        helper.make_node("Transpose", [q + "_rows_d"], [out], name=q + "_Transpose", perm=[2, 0, 1]),
    ])


def block_lookups4(model, names: set[str], block: int) -> set[str]:
    """Make each embedding lookup among the Gather nodes `names` (along axis 0 of a (vocab, d_model) table) a
    GatherBlockQuantized of a 4-bit copy of its table, a scale per `block` entries of each row; returns their names."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    lookups = [n for n in model.graph.node if n.op_type == "Gather" and n.name in names
               and not any(a.name == "axis" and a.i != 0 for a in n.attribute)]
    # GatherBlockQuantized wants whole blocks: a table of another width keeps its lookup as it was
    lookups = [n for n in lookups if inits[n.input[0]].dims[1] % block == 0]
    done = {n.name for n in lookups}
    for node in lookups:
        table = inits[node.input[0]]
        w = numpy_helper.to_array(table).astype(np.float32)  # (vocab, d_model)
        blocks = w.shape[1] // block
        scales = np.maximum(np.abs(w.reshape(len(w), blocks, block)).max(axis=2), 1e-12) / WEIGHT_MAX[4]
        q = np.clip(np.round(w / np.repeat(scales, block, axis=1)), -WEIGHT_MAX[4], WEIGHT_MAX[4]) + ZERO[4]
        base = node.input[0]
        model.graph.initializer.extend([numpy_helper.from_array(pack_nibbles(q), f"{base}_q4"),
                                        numpy_helper.from_array(scales.astype(np.float32), f"{base}_q4_scales")])
        if sum(base in n.input for n in model.graph.node) == 1:
            model.graph.initializer.remove(table)
        new = helper.make_node(
            "GatherBlockQuantized", [f"{base}_q4", node.input[1], f"{base}_q4_scales"], list(node.output),
            name=node.name + "_Q4", domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=block, bits=4)
        model.graph.node.remove(node)
        model.graph.node.append(new)
    return done
