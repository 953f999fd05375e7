"""Knowledge distillation as a loss for the shared trainer: `fit(..., loss_fn=distill_loss(teacher, cfg))`.

The student learns from the references (cross-entropy) and from the teacher's output distribution (KL divergence
of temperature-softened logits, scaled by T² as in Hinton et al., 2015), optionally also matching the teacher's
last encoder and decoder hidden states (mean squared error). The teacher runs without gradients, in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from t5compress.config import option, require


@dataclass(frozen=True)
class DistillConfig:
    temperature: float = option(2.0, "Softmax temperature of the distillation KL term.")
    alpha: float = option(0.5, "Weight of the KL term; the cross-entropy on the references gets 1 - alpha.")
    hidden_weight: float = option(0.0, "Weight of the MSE between student and teacher last hidden states (0: off).")

    def __post_init__(self) -> None:
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(0 <= self.alpha <= 1, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(self.hidden_weight >= 0, "hidden_weight", f"must be >= 0, got {self.hidden_weight}")


def distill_loss(teacher, cfg: DistillConfig) -> Callable:
    """A `loss_fn(model, batch, label_smoothing)` for `trainer.fit` that distils from `teacher`."""
    import torch
    import torch.nn.functional as F

    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    hidden = cfg.hidden_weight > 0

    def loss(model, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        out = model(**inputs, output_hidden_states=hidden)
        device = out.logits.device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad():
            ref = teacher(**inputs, output_hidden_states=hidden)
        labels = batch["labels"]  # (batch, tgt_len)
        keep = labels != -100
        s, t = out.logits.float(), ref.logits.float()  # (batch, tgt_len, vocab)
        ce = F.cross_entropy(s.reshape(-1, s.size(-1)), labels.reshape(-1), ignore_index=-100,
                             label_smoothing=label_smoothing)
        temp = cfg.temperature
        kl = F.kl_div(F.log_softmax(s / temp, -1), F.log_softmax(t / temp, -1), log_target=True, reduction="none")
        kl = kl.sum(-1)[keep].mean() * temp * temp  # per target token
        total = (1 - cfg.alpha) * ce + cfg.alpha * kl
        if hidden:
            pairs = ((out.encoder_last_hidden_state, ref.encoder_last_hidden_state),
                     (out.decoder_hidden_states[-1], ref.decoder_hidden_states[-1]))
            total = total + cfg.hidden_weight * sum(F.mse_loss(a.float(), b.float()) for a, b in pairs)
        return total

    return loss
