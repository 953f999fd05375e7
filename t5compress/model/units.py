"""The low level: shrink real layers of a Hugging Face T5 (rows and columns removed, not masked).

    prune_heads(attn, keep)        q/k/v rows and o columns of the kept heads; n_heads and inner_dim updated
    prune_ffn(ff, keep)            FFN channels (relu or gated): wi / wi_0 / wi_1 rows and wo columns
    drop_blocks(stack, keep)       whole blocks; the relative attention bias moves to the new first block
    sync_stack(stack)              one relative-bias table per stack: slice it or let each layer pick its columns

T5 shares one relative-position bias table (owned by block 0 of each stack) between all the stack's self-attention
layers: layer l's head j adds column j of the bias that block 0 computed. So when layers keep different heads, each
layer must pick its own columns out of the full table: Hugging Face's own `pruned_heads` mask (original head indices
removed) does that, and `sync_stack` sets it. When every layer keeps the same heads, the table itself is sliced and
the result is a plain T5 (`from_pretrained` loads it). Hugging Face's `prune_heads` slices block 0's table even when
the other layers keep other heads, and crashes on cross-attention (its zero bias is built with block 0's reduced
head count): it is not used. Cross-attention has no bias table, only zeros plus the encoder mask, so layers with other
head counts than block 0 take one (identical) column of it (`_one_bias_column`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _slice_linear(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    """A new bias-free Linear keeping `index` along `dim` of the weight (0: outputs, 1: inputs)."""
    w = linear.weight.detach().index_select(dim, index.to(linear.weight.device)).clone()
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    out.weight.requires_grad_(linear.weight.requires_grad)
    return out


def _check_keep(keep: Sequence[int], n: int, what: str) -> torch.Tensor:
    idx = sorted(int(i) for i in keep)
    if not idx:
        raise ValueError(f"{what}: keep at least one")
    if len(set(idx)) != len(idx) or idx[0] < 0 or idx[-1] >= n:
        raise ValueError(f"{what}: keep must be distinct indices in [0, {n}), got {list(keep)}")
    return torch.tensor(idx, dtype=torch.long)


def table_width(attn: nn.Module) -> int:
    """Heads the attention had when its stack's bias table was last sliced: current heads plus pruned ones."""
    return attn.n_heads + len(attn.pruned_heads)


def kept_columns(attn: nn.Module) -> list[int]:
    """Bias-table columns of the heads `attn` holds, in order."""
    return [c for c in range(table_width(attn)) if c not in attn.pruned_heads]


def prune_heads(attn: nn.Module, keep: Sequence[int]) -> nn.Module:
    """Keep heads `keep` (indices into the current heads) of a `T5Attention`, in place; returns it.

    Removed heads are recorded in `attn.pruned_heads` (as bias-table columns), so a shared relative bias keeps
    adding the right column to each kept head; call `sync_stack` on the stack afterwards.
    """
    idx = _check_keep(keep, attn.n_heads, "prune_heads")
    d = attn.key_value_proj_dim
    rows = (idx[:, None] * d + torch.arange(d)[None, :]).reshape(-1)  # (kept * d_kv,) rows of q/k/v
    columns = kept_columns(attn)
    attn.q, attn.k, attn.v = (_slice_linear(m, rows, 0) for m in (attn.q, attn.k, attn.v))
    attn.o = _slice_linear(attn.o, rows, 1)
    width = table_width(attn)
    attn.n_heads = len(idx)
    attn.inner_dim = attn.n_heads * d
    attn.pruned_heads = set(range(width)) - {columns[i] for i in idx.tolist()}
    return attn


def ffn_linears(ff: nn.Module) -> tuple[list[nn.Linear], nn.Linear]:
    ins = [ff.wi] if hasattr(ff, "wi") else [ff.wi_0, ff.wi_1]
    return ins, ff.wo


def ffn_width(ff: nn.Module) -> int:
    return ff.wo.in_features


def prune_ffn(ff: nn.Module, keep: Sequence[int]) -> nn.Module:
    """Keep FFN channels `keep` of a `T5DenseActDense` or `T5DenseGatedActDense`, in place; returns it.

    torch-pruning's dependency graph finds the coupled layers (wo's inputs, wi's or wi_0's and wi_1's outputs,
    through the activation and the gate product); it is built on this one module, so it costs milliseconds.
    """
    import torch_pruning as tp

    n = ffn_width(ff)
    idx = _check_keep(keep, n, "prune_ffn")
    removed = sorted(set(range(n)) - set(idx.tolist()))
    if not removed:
        return ff
    d_model = ff.wo.out_features
    w = ff.wo.weight
    graph = tp.DependencyGraph().build_dependency(ff, example_inputs=torch.zeros(1, 1, d_model, dtype=w.dtype,
                                                                                  device=w.device))
    group = graph.get_pruning_group(ff.wo, tp.prune_linear_in_channels, idxs=removed)
    coupled = {dep.target.module for dep, _ in group}
    ins, out = ffn_linears(ff)
    if not set(ins) | {out} <= coupled:  # a future FFN variant torch-pruning does not see through: fail loudly
        raise RuntimeError(f"torch-pruning did not couple all FFN projections of {type(ff).__name__}")
    group.prune()
    return ff


def self_attn(block: nn.Module) -> nn.Module:
    return block.layer[0].SelfAttention


def cross_attn(block: nn.Module) -> nn.Module | None:
    return block.layer[1].EncDecAttention if len(block.layer) == 3 else None


def ffn(block: nn.Module) -> nn.Module:
    return block.layer[-1].DenseReluDense


def drop_blocks(stack: nn.Module, keep: Sequence[int]) -> nn.Module:
    """Keep blocks `keep` of a `T5Stack` in order, in place; block 0's relative bias table moves to the new first."""
    idx = _check_keep(keep, len(stack.block), "drop_blocks").tolist()
    first = self_attn(stack.block[0])
    table = first.relative_attention_bias
    blocks = [stack.block[i] for i in idx]
    for i, block in enumerate(blocks):
        attn = self_attn(block)
        if i == 0 and attn is not first:
            attn.relative_attention_bias = table  # the stack's one table, now owned by its new first block
        elif i > 0 and attn.has_relative_attention_bias:
            del attn.relative_attention_bias
        attn.has_relative_attention_bias = i == 0
        attn.layer_idx = i  # cache slots are per layer
        cross = cross_attn(block)
        if cross is not None:
            cross.layer_idx = i
    stack.block = nn.ModuleList(blocks)
    stack.config.num_layers = len(blocks)
    return stack


def _one_bias_column(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Cross-attention bias = zeros + encoder mask, equal in every head: one column broadcasts to any head count.
    bias = kwargs.get("position_bias")
    if bias is not None and bias.shape[1] != module.n_heads:
        kwargs["position_bias"] = bias[:, :1]
    return args, kwargs


def sync_stack(stack: nn.Module) -> None:
    """Make a stack's position biases right after its heads were pruned (see the module docstring)."""
    selfs = [self_attn(b) for b in stack.block]
    columns = [kept_columns(a) for a in selfs]
    table = selfs[0].relative_attention_bias
    if all(c == columns[0] for c in columns) and len(columns[0]) < table.embedding_dim:
        keep = torch.tensor(columns[0], dtype=torch.long)
        new = nn.Embedding(table.num_embeddings, len(keep), device=table.weight.device, dtype=table.weight.dtype)
        new.weight.data.copy_(table.weight.detach().index_select(1, keep.to(table.weight.device)))
        selfs[0].relative_attention_bias = new
        for a in selfs:
            a.pruned_heads = set()
    crosses = [c for c in (cross_attn(b) for b in stack.block) if c is not None]
    for c in crosses:
        c.pruned_heads = set()  # no table: Hugging Face's mask would index block 0's zero bias out of range
        uneven = c.n_heads != crosses[0].n_heads
        hooked = getattr(c, "_t5c_bias_hook", None)
        if uneven and hooked is None:
            c._t5c_bias_hook = c.register_forward_pre_hook(_one_bias_column, with_kwargs=True)
        elif not uneven and hooked is not None:
            hooked.remove()
            del c._t5c_bias_hook


def is_plain(model: nn.Module) -> bool:
    """Whether the model has one head count, one FFN width and no per-layer bias columns: a plain T5 config."""
    heads, widths = set(), set()
    for stack in (model.encoder, model.decoder):
        for b in stack.block:
            a = self_attn(b)
            if a.pruned_heads:
                return False
            heads.add(a.n_heads)
            c = cross_attn(b)
            if c is not None:
                heads.add(c.n_heads)
            widths.add(ffn_width(ffn(b)))
    return len(heads) == 1 and len(widths) == 1
