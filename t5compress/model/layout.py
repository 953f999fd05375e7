"""Per-layer sizes of a non-uniformly pruned T5, recorded in its config.json, and the loader that rebuilds it.

A plain T5 config has one `num_heads` and one `d_ff`. After `global` pruning (or different encoder and decoder
ratios) layers differ, and the directory's config.json carries `t5compress_layout`:

    {"encoder": {"table": 8, "blocks": [{"heads": [0, 2, 5], "d_ff": 1024}, ...]},
     "decoder": {"table": 8, "blocks": [{"heads": [1, 2], "cross_heads": 5, "d_ff": 700}, ...]}}

`table` is the width of the stack's relative-bias table, `heads` the table columns of the heads each layer keeps
(see `units`). `num_heads` and `d_ff` in the config are then the largest sizes. `load_pruned` builds that model and
loads its weights; plain `from_pretrained` refuses it (shape mismatch), as it should.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from t5compress import kinds
from t5compress.kinds import LAYOUT_KEY
from t5compress.model import units


def layout_of(model) -> dict[str, Any]:
    """The per-layer sizes of `model`."""
    out: dict[str, Any] = {}
    for name, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        blocks = []
        for b in stack.block:
            entry: dict[str, Any] = {"heads": units.kept_columns(units.self_attn(b))}
            cross = units.cross_attn(b)
            if cross is not None:
                entry["cross_heads"] = cross.n_heads
            entry["d_ff"] = units.ffn_width(units.ffn(b))
            blocks.append(entry)
        out[name] = {"table": units.table_width(units.self_attn(stack.block[0])), "blocks": blocks}
    return out


def sync_config(model) -> None:
    """Write the model's real sizes into its config: plain fields when uniform, else `t5compress_layout` too."""
    c = model.config
    c.num_layers, c.num_decoder_layers = len(model.encoder.block), len(model.decoder.block)
    model.encoder.config.num_layers = c.num_layers
    model.decoder.config.num_layers = c.num_decoder_layers
    lay = layout_of(model)
    blocks = lay["encoder"]["blocks"] + lay["decoder"]["blocks"]
    heads = [lay[s]["table"] for s in ("encoder", "decoder")] + [b.get("cross_heads", 0) for b in blocks]
    c.num_heads = max(heads)
    c.d_ff = max(b["d_ff"] for b in blocks)
    if units.is_plain(model):
        if hasattr(c, LAYOUT_KEY):
            delattr(c, LAYOUT_KEY)
    else:
        setattr(c, LAYOUT_KEY, lay)
    for stack in (model.encoder, model.decoder):
        stack.config.num_heads, stack.config.d_ff = c.num_heads, c.d_ff
        if units.is_plain(model):
            stack.config.__dict__.pop(LAYOUT_KEY, None)
        else:
            setattr(stack.config, LAYOUT_KEY, lay)


def apply_layout(model, lay: dict[str, Any]) -> None:
    """Shrink a freshly built full-size model to `lay` (its weights are then loaded over it)."""
    for name, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        spec = lay[name]
        selfs = [units.self_attn(b) for b in stack.block]
        if spec["table"] < selfs[0].n_heads:
            for a in selfs:
                units.prune_heads(a, range(spec["table"]))
            units.sync_stack(stack)
        for block, entry in zip(stack.block, spec["blocks"], strict=True):
            attn = units.self_attn(block)
            if len(entry["heads"]) < attn.n_heads:
                units.prune_heads(attn, entry["heads"])
            cross = units.cross_attn(block)
            if cross is not None and entry["cross_heads"] < cross.n_heads:
                units.prune_heads(cross, range(entry["cross_heads"]))
            ff = units.ffn(block)
            if entry["d_ff"] < units.ffn_width(ff):
                units.prune_ffn(ff, range(entry["d_ff"]))
        units.sync_stack(stack)


def has_layout(path: str | Path) -> bool:
    return kinds.has_layout(Path(path))


def load_pruned(path: str | Path, dtype=None):
    """Build a model with recorded per-layer sizes and load its safetensors weights (strictly)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from t5compress.errors import ModelError
    from t5compress.model.weights import load_safetensors, weight_files

    path = Path(path)
    config = T5Config.from_pretrained(path)
    model = T5ForConditionalGeneration(config)
    apply_layout(model, getattr(config, LAYOUT_KEY))
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        state.update(load_safetensors(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    if config.tie_word_embeddings:
        tied.add("lm_head.weight")
    if unexpected or set(missing) - tied:
        bad = unexpected or sorted(set(missing) - tied)
        raise ModelError(f"'{path}': weights do not match its {LAYOUT_KEY}: {bad[:3]}")
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def decoder_heads(config) -> list[tuple[int, int]]:
    """(self-attention heads, cross-attention heads) per decoder layer: what the exported cache tensors hold."""
    lay = getattr(config, LAYOUT_KEY, None)
    if not lay:
        return [(config.num_heads, config.num_heads)] * config.num_decoder_layers
    return [(len(b["heads"]), b["cross_heads"]) for b in lay["decoder"]["blocks"]]
