"""Pre-train a T5 with span corruption (nanoT5-style), from scratch or continued from a checkpoint.

    from t5compress.pretrain import PretrainConfig, run
    report = run("corpus.jsonl", PretrainConfig(model="t5-efficient-small-el2"), "pretrained-dir")

Layers, each public: `spans` (T5's length arithmetic, span masks and the batch collator), `corpus` (streamed
documents from text, JSON Lines, folders or datasets), `stream` (packed, shuffled, prefetched training batches and
the held-out loss), `stage` (the config and `run`). The training loop is the shared `t5compress.train.loop`.
"""

from t5compress.pretrain.spans import SpanCorruption, apply_mask, compute_input_and_target_lengths, noise_mask, pack
from t5compress.pretrain.stage import NANOT5, PretrainConfig, run

__all__ = ["NANOT5", "PretrainConfig", "SpanCorruption", "apply_mask", "compute_input_and_target_lengths",
           "noise_mask", "pack", "run"]
