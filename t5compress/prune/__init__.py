"""Structured pruning of T5: attention heads, FFN channels and whole blocks really removed, then recovery.

    from t5compress.prune import PruneConfig, run
    report = run("model-dir", PruneConfig(calib_data="data.jsonl", heads=0.5, ffn=0.5), "pruned-dir")

Layers, each public: `units` shrinks real layers (`prune_heads(attn, keep)`, `prune_ffn(ff, keep)`,
`drop_blocks(stack, keep)`); `importance` scores units on calibration batches (registry `SCORES`: taylor,
activation, magnitude); `schedule` turns scores into a plan (registry `SCHEDULES`: uniform, global) and applies it;
`layout` records per-layer sizes of non-uniform models and loads them; `recover` fine-tunes a pruned model through
the shared trainer, optionally distilling from the unpruned one; `stage` is the `prune` stage.
"""

from t5compress.prune.stage import PruneConfig, run

__all__ = ["PruneConfig", "run"]
