"""AdamW with an RMS-scaled step (nanoT5's `adamwscale`): Adam's update times max(1e-3, RMS(parameter)).

Adafactor scales its step by the parameter's root mean square, which is what lets T5 pre-train at a constant
1e-2-ish learning rate; nanoT5 found plain AdamW diverges there and AdamW with that one change matches Adafactor.
This implementation works on all parameters at once with `torch._foreach_*` kernels (few Python calls per step).
"""

from __future__ import annotations

import math

import torch


class AdamWScale(torch.optim.Optimizer):
    """AdamW whose step for each tensor is `lr * max(1e-3, rms(p))`; decoupled weight decay as in AdamW."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
            beta1, beta2 = group["betas"]
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(m, grads, 1 - beta1)  # m = beta1 m + (1 - beta1) g
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            step = float(self.state[params[0]]["step"])
            correction = math.sqrt(1 - beta2**step) / (1 - beta1**step)
            rms = [float(n) / math.sqrt(p.numel()) for n, p in zip(torch._foreach_norm(params), params, strict=True)]
            sizes = [-group["lr"] * correction * max(1e-3, r) for r in rms]
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, m, denom, sizes)
            if group["weight_decay"] > 0:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        return loss
