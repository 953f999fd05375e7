"""Knowledge distillation as a loss for the shared trainer: `fit(..., loss_fn=distill_loss(teacher, cfg))`.

The student learns from the references (cross-entropy) and from the teacher's output distribution (KL divergence
of temperature-softened logits, scaled by T² as in Hinton et al., 2015), optionally also matching the teacher's
hidden states (mean squared error): the last of each stack, or every block's output (layer-wise distillation, as
CoFi and nn_pruning do after pruning; each layer's error divided by the teacher's mean square there, so that layers
whose residual stream is larger do not dominate). The teacher runs without gradients, in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from t5compress.config import option, require

HIDDEN_LAYERS = ("last", "all")


@dataclass(frozen=True)
class DistillConfig:
    temperature: float = option(2.0, "Softmax temperature of the distillation KL term.")
    alpha: float = option(0.5, "Weight of the KL term; the cross-entropy on the references gets 1 - alpha.")
    hidden_weight: float = option(0.0, "Weight of the MSE between student and teacher hidden states (0: off).")
    hidden_layers: str = option("last", "Hidden states matched: last (each stack's output) or all (every block's "
                                         "output, error relative to the teacher's scale; layer-wise distillation).")

    def __post_init__(self) -> None:
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(0 <= self.alpha <= 1, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(self.hidden_weight >= 0, "hidden_weight", f"must be >= 0, got {self.hidden_weight}")
        require(self.hidden_layers in HIDDEN_LAYERS, "hidden_layers", f"choose one of {', '.join(HIDDEN_LAYERS)}")


def _layer_pairs(student: tuple, teacher: tuple) -> list[tuple]:
    """(student, teacher) block outputs, embeddings left out; a shallower student's block j meets the teacher's block
    at the same relative depth."""
    s, t = student[1:], teacher[1:]
    return [(s[j], t[round((j + 1) * len(t) / len(s)) - 1]) for j in range(len(s))]


def layerwise_mse(student: tuple, teacher: tuple, mask):
    """Mean over blocks of the masked MSE of block outputs, each divided by the teacher's mean square there."""
    import torch

    keep = mask[..., None].float()  # (batch, len, 1): real tokens only
    n = keep.sum().clamp(min=1) * student[0].size(-1)
    terms = []
    for a, b in _layer_pairs(student, teacher):
        a, b = a.float(), b.float()  # (batch, len, d_model)
        err = ((a - b).pow(2) * keep).sum() / n
        terms.append(err / ((b.pow(2) * keep).sum() / n).clamp(min=1e-6))
    return torch.stack(terms).mean()


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
        if hidden and cfg.hidden_layers == "all":
            total = total + cfg.hidden_weight * (
                layerwise_mse(out.encoder_hidden_states, ref.encoder_hidden_states, batch["attention_mask"])
                + layerwise_mse(out.decoder_hidden_states, ref.decoder_hidden_states, keep))
        elif hidden:
            pairs = ((out.encoder_last_hidden_state, ref.encoder_last_hidden_state),
                     (out.decoder_hidden_states[-1], ref.decoder_hidden_states[-1]))
            total = total + cfg.hidden_weight * sum(F.mse_loss(a.float(), b.float()) for a, b in pairs)
        return total

    return loss
