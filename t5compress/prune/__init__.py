"""Structured pruning of T5: attention heads, FFN channels and whole blocks really removed, then recovery.

    from t5compress.prune import PruneConfig, run
    report = run("model-dir", PruneConfig(calib_data="data.jsonl", heads=0.5, ffn=0.5), "pruned-dir")

Layers, each public: the lowest ones live with the model, since loading a pruned model needs them too:
`t5compress.model.units` shrinks real layers (`prune_heads(attn, keep)`, `prune_ffn(ff, keep)`,
`drop_blocks(stack, keep)`) and `t5compress.model.layout` records per-layer sizes of non-uniform models and loads
them. Here: `importance` scores units on calibration batches (registry `SCORES`: taylor, activation, magnitude);
`schedule` turns scores into a plan (registry `SCHEDULES`: uniform, global) and applies it; `recover` fine-tunes a
pruned model through the shared loop, by default distilling from the unpruned one; `stage` is the `prune` stage.
"""

from t5compress.prune.stage import PruneConfig, run

__all__ = ["PruneConfig", "run"]
