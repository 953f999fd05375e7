"""The middle layer: importance scores of heads, FFN channels and blocks, measured on calibration batches.

    scores = SCORES["taylor"](model, batches)    # {"encoder.heads": [(heads,) per layer], ...}

Groups: `encoder.heads`, `decoder.heads` (self-attention), `decoder.cross` (cross-attention), `encoder.ffn`,
`decoder.ffn` (channels), `encoder.blocks`, `decoder.blocks` (one score per block). Every criterion scores a unit
whose weights are all zero exactly 0, so such units are removed first.

Gates make the units visible: a head's output (the input of `o`, split in heads), an FFN channel (the input of `wo`)
and a block's residual update are multiplied by a gate of ones. With a gate, first-order Taylor importance is the
gradient of the loss with respect to it (the head-mask gradient of Michel et al., 2019), summed in absolute value
over batches; the activation criterion is the mean L2 norm of what the gate multiplies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from t5compress.model import units

Scores = dict[str, list[torch.Tensor]]
GROUPS = ("encoder.heads", "decoder.heads", "decoder.cross", "encoder.ffn", "decoder.ffn", "encoder.blocks",
          "decoder.blocks")


def units_of(model) -> dict[str, list[tuple[str, nn.Module]]]:
    """For each group, per layer: (kind, module) where kind is 'heads', 'ffn' or 'block'."""
    out: dict[str, list[tuple[str, nn.Module]]] = {g: [] for g in GROUPS}
    for name, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        for b in stack.block:
            out[f"{name}.heads"].append(("heads", units.self_attn(b)))
            cross = units.cross_attn(b)
            if cross is not None:
                out["decoder.cross"].append(("heads", cross))
            out[f"{name}.ffn"].append(("ffn", units.ffn(b)))
            out[f"{name}.blocks"].append(("block", b))
    return out


def _size(kind: str, module: nn.Module) -> int:
    return {"heads": lambda m: m.n_heads, "ffn": units.ffn_width, "block": lambda m: 1}[kind](module)


@contextlib.contextmanager
def _gates(model, on_gate: Callable[[str, int, torch.Tensor, torch.Tensor], None] | None,
           requires_grad: bool) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Install gates of ones on every unit; `on_gate(group, layer, gate, gated_input)` sees each gated tensor."""
    gates: dict[str, list[torch.Tensor]] = {}
    handles = []
    device = next(model.parameters()).device

    def gate_input(group: str, i: int, g: torch.Tensor, per: int):
        def hook(module, args):
            x = args[0]  # (batch, len, units * per)
            shaped = x.unflatten(-1, (g.numel(), per))  # (batch, len, units, per)
            if on_gate is not None:
                on_gate(group, i, g, shaped)
            return ((shaped * g[:, None].to(x.dtype)).flatten(-2),) + tuple(args[1:])
        return hook

    def gate_block(group: str, i: int, g: torch.Tensor):
        def pre(module, args, kwargs):
            module._t5c_in = args[0] if args else kwargs["hidden_states"]

        def post(module, args, kwargs, output):
            x = module._t5c_in
            delta = output[0] - x  # (batch, len, d_model): what the block adds to the residual stream
            if on_gate is not None:
                on_gate(group, i, g, delta[..., None, :])
            return (x + g.to(x.dtype) * delta,) + tuple(output[1:])
        return pre, post

    try:
        for group, layer_units in units_of(model).items():
            gates[group] = []
            for i, (kind, m) in enumerate(layer_units):
                g = torch.ones(_size(kind, m), device=device, requires_grad=requires_grad)
                gates[group].append(g)
                if kind == "heads":
                    handles.append(m.o.register_forward_pre_hook(gate_input(group, i, g, m.key_value_proj_dim)))
                elif kind == "ffn":
                    handles.append(m.wo.register_forward_pre_hook(gate_input(group, i, g, 1)))
                else:
                    pre, post = gate_block(group, i, g)
                    handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                    handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield gates
    finally:
        for h in handles:
            h.remove()
        for _, layer_units in units_of(model).items():
            for _, m in layer_units:
                m.__dict__.pop("_t5c_in", None)


def _loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from t5compress.train.evaluation import token_loss

    return token_loss(model, batch)


def taylor(model, batches: Iterable[dict[str, torch.Tensor]]) -> Scores:
    """|d loss / d gate| per unit, summed over batches: the loss change if the unit were removed, to first order."""
    was = model.training
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # only the gates need gradients: the backward pass skips every weight gradient
        p.requires_grad_(False)
    totals: Scores = {}
    try:
        with _gates(model, None, requires_grad=True) as gates:
            totals = {k: [torch.zeros_like(g) for g in v] for k, v in gates.items()}
            for batch in batches:
                _loss(model, batch).backward()
                for k, gs in gates.items():
                    for t, g in zip(totals[k], gs, strict=True):
                        t += g.grad.detach().abs()
                        g.grad = None
    finally:
        for p in params:
            p.requires_grad_(True)
        model.train(was)
    return {k: [t.cpu() for t in v] for k, v in totals.items()}


@torch.no_grad()
def activation(model, batches: Iterable[dict[str, torch.Tensor]]) -> Scores:
    """Mean L2 norm of each unit's output (head output, channel activation, block update) over tokens."""
    sums: Scores = {}
    counts: dict[str, list[int]] = {}

    def seen(group: str, i: int, g: torch.Tensor, x: torch.Tensor) -> None:
        norms = x.float().norm(dim=-1).reshape(-1, g.numel())  # (tokens, units)
        sums[group][i] += norms.sum(0)
        counts[group][i] += norms.shape[0]

    was = model.training
    model.eval()
    try:
        with _gates(model, seen, requires_grad=False) as gates:
            sums.update({k: [torch.zeros_like(g) for g in v] for k, v in gates.items()})
            counts.update({k: [0] * len(v) for k, v in gates.items()})
            for batch in batches:
                _loss(model, batch)
    finally:
        model.train(was)
    return {k: [(s / max(n, 1)).cpu() for s, n in zip(v, counts[k], strict=True)] for k, v in sums.items()}


@torch.no_grad()
def magnitude(model, batches: Iterable[dict[str, torch.Tensor]] | None = None) -> Scores:
    """L2 norm of each unit's weights (no data needed); a block's is the norm of its output projections."""
    out: Scores = {}
    for group, layer_units in units_of(model).items():
        out[group] = []
        for kind, m in layer_units:
            if kind == "heads":
                d = m.key_value_proj_dim
                rows = [w.weight.unflatten(0, (m.n_heads, d)).pow(2).sum((1, 2)) for w in (m.q, m.k, m.v)]
                cols = m.o.weight.unflatten(1, (m.n_heads, d)).pow(2).sum((0, 2))
                out[group].append((sum(rows) + cols).sqrt().cpu())
            elif kind == "ffn":
                ins, wo = units.ffn_linears(m)
                sq = sum(w.weight.pow(2).sum(1) for w in ins) + wo.weight.pow(2).sum(0)
                out[group].append(sq.sqrt().cpu())
            else:
                projections = [units.self_attn(m).o, units.ffn(m).wo]
                cross = units.cross_attn(m)
                if cross is not None:
                    projections.append(cross.o)
                out[group].append(torch.stack([p.weight.pow(2).sum() for p in projections]).sum().sqrt()[None].cpu())
    return out


SCORES: dict[str, Callable[..., Scores]] = {"taylor": taylor, "activation": activation, "magnitude": magnitude}
