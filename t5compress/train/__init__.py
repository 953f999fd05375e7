"""Fine-tuning: the `train` stage and the loop every training stage shares (train, qat, recover, pretrain).

    from t5compress.train.stage import FinetuneConfig, run
    report = run("model-dir", FinetuneConfig(train_data="train.jsonl"), "trained-dir")

Layers, each public: `loop` (the step loop, evaluation during training, checkpoints and early stopping: `fit`),
`stage` (the `train` stage and the session every fine-tuning stage opens), `evaluation` (generate and score),
`distill` (the distillation loss of recovery), `optim` (AdamWScale), `checkpoint` (resumable checkpoints).
"""
