"""Schedules: which heads, channels and blocks to keep, from importance scores.

    plan = SCHEDULES["uniform"](model, scores, targets)   # {"encoder.heads": [[kept] per kept layer], ...}
    apply_plan(model, plan)                                 # shrinks the model in place

`uniform` keeps the same number of units in every layer. Self-attention heads keep the same indices in every
layer of a stack (ranked by their score summed over the stack's layers): the stack shares one relative-bias table,
so only then is the result a plain T5 that `from_pretrained` loads, bit-exact (see `units`). Cross-attention heads
and FFN channels are chosen per layer. `global` ranks the units of a group across all layers (scores normalised
by each layer's mean, so that layers with larger gradients do not lose everything else first) and keeps at least
one per layer; layers end up with different sizes, recorded by `layout`.
Blocks (`encoder.blocks`, `decoder.blocks`) are chosen first, by their block score; units are chosen in the kept
blocks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from t5compress.errors import ConfigError
from t5compress.model import layout, units
from t5compress.prune.importance import Scores, units_of

Plan = dict[str, list]
UNIT_GROUPS = ("encoder.heads", "decoder.heads", "decoder.cross", "encoder.ffn", "decoder.ffn")
_WHAT = {"encoder.heads": "encoder self-attention heads", "decoder.heads": "decoder self-attention heads",
         "decoder.cross": "cross-attention heads", "encoder.ffn": "encoder FFN channels",
         "decoder.ffn": "decoder FFN channels"}


@dataclass(frozen=True)
class Targets:
    """Share of units removed per group (0 keeps all) and blocks kept per stack (None keeps all)."""

    ratios: dict[str, float]
    encoder_layers: int | None = None
    decoder_layers: int | None = None


def _keep_blocks(scores: Scores, stack: str, n_keep: int | None) -> list[int]:
    s = torch.cat(scores[f"{stack}.blocks"])  # (layers,)
    n = s.numel()
    if n_keep is None or n_keep >= n:
        if n_keep is not None and n_keep > n:
            raise ConfigError(f"{stack}_layers: the model has {n} {stack} layers; cannot keep {n_keep}")
        return list(range(n))
    if n_keep < 1:
        raise ConfigError(f"{stack}_layers: must keep at least 1 layer, got {n_keep}")
    order = torch.argsort(s, descending=True, stable=True)[:n_keep]
    return sorted(order.tolist())


def _n_removed(n: int, ratio: float, group: str) -> int:
    removed = round(n * ratio)
    if removed >= n:
        raise ConfigError(f"ratio {ratio} for {_WHAT[group]} removes all {n} of a layer; use a smaller ratio "
                          f"(below {(n - 0.5) / n:.3f}) so that every layer keeps one")
    return removed


def _lowest_out(s: torch.Tensor, n_remove: int) -> list[int]:
    order = torch.argsort(s, stable=True)  # ascending: zero-importance units first, ties by index
    return sorted(order[n_remove:].tolist())


def _same_columns(model, group: str, layers: list[int]) -> bool:
    attns = [m for _, m in (units_of(model)[group][i] for i in layers)]
    return all(units.kept_columns(a) == units.kept_columns(attns[0]) for a in attns)


def uniform(model, scores: Scores, targets: Targets) -> Plan:
    plan: Plan = {s + ".blocks": _keep_blocks(scores, s, getattr(targets, f"{s}_layers"))
                  for s in ("encoder", "decoder")}
    for group in UNIT_GROUPS:
        layers = plan[group.split(".")[0] + ".blocks"]
        per_layer = [scores[group][i] for i in layers]
        ratio = targets.ratios.get(group, 0.0)
        shared = group.endswith(".heads") and _same_columns(model, group, layers)
        if shared and len({s.numel() for s in per_layer}) == 1:
            keep = _lowest_out(torch.stack(per_layer).sum(0), _n_removed(per_layer[0].numel(), ratio, group))
            plan[group] = [keep] * len(layers)
        else:
            plan[group] = [_lowest_out(s, _n_removed(s.numel(), ratio, group)) for s in per_layer]
    return plan


def global_(model, scores: Scores, targets: Targets) -> Plan:
    plan: Plan = {s + ".blocks": _keep_blocks(scores, s, getattr(targets, f"{s}_layers"))
                  for s in ("encoder", "decoder")}
    for group in UNIT_GROUPS:
        layers = plan[group.split(".")[0] + ".blocks"]
        per_layer = [scores[group][i].double() for i in layers]
        sizes = [s.numel() for s in per_layer]
        total = sum(sizes)
        to_remove = round(total * targets.ratios.get(group, 0.0))
        if to_remove > total - len(sizes):
            raise ConfigError(f"ratio {targets.ratios[group]} for {_WHAT[group]} would remove {to_remove} of "
                              f"{total}; every layer must keep one, so at most {total - len(sizes)} can go")
        normed = torch.cat([s / s.mean() if s.mean() > 0 else s for s in per_layer])
        owner = torch.cat([torch.full((n,), j) for j, n in enumerate(sizes)])
        left = list(sizes)
        removed: list[set[int]] = [set() for _ in sizes]
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        for flat in torch.argsort(normed, stable=True).tolist():
            if to_remove == 0:
                break
            j = int(owner[flat])
            if left[j] > 1:
                removed[j].add(flat - offsets[j])
                left[j] -= 1
                to_remove -= 1
        plan[group] = [[i for i in range(n) if i not in removed[j]] for j, n in enumerate(sizes)]
    return plan


SCHEDULES: dict[str, Callable[..., Plan]] = {"uniform": uniform, "global": global_}


def apply_plan(model, plan: Plan) -> None:
    """Shrink `model` in place to `plan`, then make its position biases and its config match."""
    all_units = units_of(model)
    for group in UNIT_GROUPS:
        layers = plan[group.split(".")[0] + ".blocks"]
        for i, keep in zip(layers, plan[group], strict=True):
            kind, m = all_units[group][i]
            if len(keep) < (m.n_heads if kind == "heads" else units.ffn_width(m)):
                (units.prune_heads if kind == "heads" else units.prune_ffn)(m, keep)
    for stack, name in ((model.encoder, "encoder"), (model.decoder, "decoder")):
        if len(plan[f"{name}.blocks"]) < len(stack.block):
            units.drop_blocks(stack, plan[f"{name}.blocks"])
        units.sync_stack(stack)
    layout.sync_config(model)


def summary(plan: Plan) -> dict:
    """Kept units per layer of each group (for the report)."""
    out = {g: [len(k) for k in plan[g]] for g in UNIT_GROUPS}
    out.update({g: plan[g] for g in ("encoder.blocks", "decoder.blocks")})
    return out
