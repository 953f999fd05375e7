"""Int8 fake quantization for quantization-aware training (QAT) of T5, and the scales file beside a model dir.

    model = prepare(model, FakeQuantConfig())      # swaps Linear (and the embedding) for fake-quant versions
    calibrate(model, batches)                      # observes activation ranges, sets the initial scales
    ... train ...
    save_scales(model, out); strip(model)          # plain HF weights + quantization.json / quantization.safetensors

Scheme (what the ONNX export writes as QuantizeLinear / DequantizeLinear, with the same numbers):
- weights: int8, symmetric, per output channel, range [-w_max, w_max], scale = max|row| / w_max (recomputed from
  the current weights at every forward, so training moves weights and scales together); w_max is 127, or 63 where
  the int8 kernels saturate (x86 without VNNI, `t5compress.cpu`), recorded in quantization.json;
- activations: per tensor, uint8 (x86's fast u8 x s8 kernels) with zero point 128 (signed input) or 0 (input
  that was never negative during calibration, e.g. after ReLU); the scale is observed during calibration, then
  learned (LSQ: the gradient flows into the scale, kept as its log so that Adam's steps are relative) or an
  exponential moving average of the observed range;
- straight-through estimator for rounding; values clipped by the range get no gradient (LSQ).
Modules that read the same tensor share one activation quantizer (self-attention q/k/v, cross-attention k/v, the
gated FFN's wi_0/wi_1), so the graph quantizes that tensor once. The wrappers subclass nn.Linear / nn.Embedding and
keep `.weight` as the original Parameter: tied weights stay tied and T5's FFN can read `wo.weight.dtype`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from t5compress.errors import ModelError
from t5compress.qat.scheme import ACT_MODES, FORMAT, SCALES_FILE, SCALES_JSON, FakeQuantConfig

log = logging.getLogger(__name__)

W_MAX = 127  # symmetric int8 weights; -128 unused so that -w is representable (63 where the kernels saturate)
A_MIN, A_MAX = 0, 255  # uint8 activations


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.round() - x).detach()


def fake_quant_act(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """uint8 per-tensor fake quantization, as ONNX QuantizeLinear then DequantizeLinear (round half to even)."""
    q = torch.clamp(_round_ste(x / scale) + zero_point, A_MIN, A_MAX)  # round before the shift, as ONNX does
    return (q - zero_point) * scale


def weight_scale(w: torch.Tensor, w_max: int = W_MAX) -> torch.Tensor:
    """Per-output-channel (row) symmetric scale of a (out, in) weight: (out,)."""
    return (w.detach().abs().amax(dim=1) / w_max).clamp_min(1e-12)


def quantize_weight(w: torch.Tensor, w_max: int = W_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values (out, in) and per-row scales (out,): what the ONNX export stores."""
    s = weight_scale(w, w_max)
    return torch.clamp(torch.round(w.detach() / s[:, None]), -w_max, w_max).to(torch.int8), s


def fake_quant_weight(w: torch.Tensor, w_max: int = W_MAX) -> torch.Tensor:
    s = weight_scale(w, w_max)[:, None]  # (out, 1)
    return torch.clamp(_round_ste(w / s), -w_max, w_max) * s


# ---------------------------------------------------------------------------------------------------------------
# Activation quantizers: observed during calibration, then learned (lsq) or averaged (ema). A small registry.


class ActQuant(nn.Module):
    """Per-tensor uint8 activation fake quantizer. `calibrating` records ranges and passes values through."""

    def __init__(self, mode: str, momentum: float = 0.99) -> None:
        super().__init__()
        self.mode, self.momentum = mode, momentum
        if ACT_MODES[mode].learned:  # log-parametrised: Adam-style steps change the scale by a relative amount
            self.log_scale = nn.Parameter(torch.tensor(0.0))
        else:
            self.register_buffer("ema_scale", torch.tensor(1.0))
        self.register_buffer("zero_point", torch.tensor(128.0))
        self.calibrating = False
        self._seen: list[tuple[float, float]] = []  # (min, max) per calibration batch

    @property
    def learned(self) -> bool:
        return ACT_MODES[self.mode].learned

    def scale(self) -> torch.Tensor:
        return self.log_scale.exp() if self.learned else self.ema_scale

    def set_scale(self, value: float | torch.Tensor) -> None:
        with torch.no_grad():
            value = torch.as_tensor(value, dtype=torch.float32).clamp_min(1e-8)
            (self.log_scale.copy_(value.log()) if self.learned else self.ema_scale.copy_(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calibrating:
            self._seen.append((float(x.detach().min()), float(x.detach().max())))
            return x
        if self.training and not self.learned:
            with torch.no_grad():
                self.ema_scale.mul_(self.momentum).add_((1 - self.momentum) * self._range_scale(x))
        scale = self.scale() if self.learned else self.ema_scale.clone()  # the buffer changes in place later on
        return fake_quant_act(x.float(), scale, self.zero_point).to(x.dtype)

    def _range_scale(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_point.item() == 0:
            return x.detach().amax().clamp_min(0) / A_MAX
        return x.detach().abs().amax() / (A_MAX - 128)

    def finish_calibration(self) -> None:
        """Zero point 0 for inputs never negative (all 256 levels on [0, max]), else 128; scale from the mean range."""
        if not self._seen:
            raise ModelError("calibration saw no activations: give at least one training batch")
        lo = min(a for a, _ in self._seen)
        signed = lo < 0
        ranges = [max(abs(a), abs(b)) if signed else b for a, b in self._seen]
        amax = max(sum(ranges) / len(ranges), 1e-6)
        self.zero_point.fill_(128.0 if signed else 0.0)
        self.set_scale(amax / ((A_MAX - 128) if signed else A_MAX))
        self.calibrating, self._seen = False, []


class QuantLinear(nn.Linear):
    """nn.Linear with fake-quantized input (per tensor) and weight (per output channel); `.weight` is unchanged."""

    act: ActQuant
    w_max: int

    @classmethod
    def wrap(cls, linear: nn.Linear, act: ActQuant, w_max: int = W_MAX) -> QuantLinear:
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.weight, q.bias = linear.weight, linear.bias  # the same Parameters: ties and optimizer state survive
        q.act, q.w_max = act, w_max
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(x), fake_quant_weight(self.weight, self.w_max).to(x.dtype), self.bias)

    def plain(self) -> nn.Linear:
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        return lin


class QuantEmbedding(nn.Embedding):
    """nn.Embedding whose table is fake-quantized per row (the same int8 rows a tied lm_head uses)."""

    w_max: int

    @classmethod
    def wrap(cls, emb: nn.Embedding, w_max: int = W_MAX) -> QuantEmbedding:
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                  "sparse"):
            setattr(q, k, getattr(emb, k))
        q.weight, q.w_max = emb.weight, w_max
        return q

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, fake_quant_weight(self.weight, self.w_max), self.padding_idx)

    def plain(self) -> nn.Embedding:
        emb = nn.Embedding.__new__(nn.Embedding)
        nn.Module.__init__(emb)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                  "sparse", "weight"):
            setattr(emb, k, getattr(self, k))
        return emb


def keeps_wo(model: nn.Module, cfg: FakeQuantConfig) -> bool:
    """Gated-gelu FFNs (T5 v1.1, Flan) have activation outliers into wo that int8 cannot hold."""
    if cfg.keep_wo == "auto":
        return bool(getattr(model.config, "is_gated_act", False))
    return cfg.keep_wo == "yes"


def _groups(model: nn.Module, cfg: FakeQuantConfig) -> list[list[str]]:
    """Linear layers to quantize, grouped by the input tensor they share (one activation quantizer per group)."""
    from transformers.models.t5.modeling_t5 import T5Attention, T5DenseActDense, T5DenseGatedActDense

    keep_wo = keeps_wo(model, cfg)
    groups: list[list[str]] = []
    for name, m in model.named_modules():
        if isinstance(m, T5Attention):
            cross = name.endswith("EncDecAttention")
            q, k, v = (f"{name}.{x}" for x in "qkv")
            groups += [[q], [k, v]] if cross else [[q, k, v]]  # cross-attention: k and v read the encoder output
            groups.append([f"{name}.o"])
        elif isinstance(m, T5DenseGatedActDense):
            groups.append([f"{name}.wi_0", f"{name}.wi_1"])
        elif isinstance(m, T5DenseActDense):
            groups.append([f"{name}.wi"])
        if isinstance(m, T5DenseActDense | T5DenseGatedActDense) and not keep_wo:
            groups.append([f"{name}.wo"])
    if cfg.lm_head:
        groups.append(["lm_head"])
    return groups


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def prepare(model: nn.Module, cfg: FakeQuantConfig, w_max: int | None = None) -> nn.Module:
    """Swap the model's Linear layers (and embedding) for fake-quant versions, in place; returns the model.
    `w_max`: the int8 weight range (default: what `cfg.weight_range` gives on this CPU)."""
    from t5compress.cpu import weight_max

    if any(isinstance(m, QuantLinear | QuantEmbedding) for m in model.modules()):
        raise ModelError("the model is already prepared for quantization-aware training")
    w_max = w_max or weight_max(cfg.weight_range)
    for group in _groups(model, cfg):
        act = ActQuant(cfg.act_scale, cfg.ema_momentum)
        for name in group:
            _set(model, name, QuantLinear.wrap(model.get_submodule(name), act, w_max))
    if cfg.embedding:
        emb = QuantEmbedding.wrap(model.shared, w_max)
        model.shared = emb
        model.encoder.embed_tokens = emb  # T5 shares one embedding module between encoder and decoder
        model.decoder.embed_tokens = emb
    return model


def strip(model: nn.Module) -> nn.Module:
    """Put plain nn.Linear / nn.Embedding back (same Parameters), in place: the fp32 model, loadable by HF alone."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear):
            _set(model, name, m.plain())
    if isinstance(model.shared, QuantEmbedding):
        emb = model.shared.plain()
        model.shared = model.encoder.embed_tokens = model.decoder.embed_tokens = emb
    return model


@contextlib.contextmanager
def plain_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily the plain fp32 model (e.g. to trace it); the fake-quant modules come back afterwards."""
    every = model.named_modules(remove_duplicate=False)  # the embedding under all three of its names
    saved = {n: m for n, m in every if isinstance(m, QuantLinear | QuantEmbedding)}
    strip(model)
    try:
        yield model
    finally:
        for name, m in saved.items():
            _set(model, name, m)


def quant_layers(model: nn.Module) -> dict[str, QuantLinear | QuantEmbedding]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)
            and not n.endswith("embed_tokens")}


def act_quantizers(model: nn.Module) -> list[ActQuant]:
    return list({id(m): m for m in model.modules() if isinstance(m, ActQuant)}.values())


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> int:
    """Run teacher-forced forwards over `batches` and set every activation quantizer's zero point and scale."""
    quants = act_quantizers(model)
    was_training = model.training
    model.eval()
    for q in quants:
        q.calibrating = True
    n = 0
    try:
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            n += 1
        for q in quants:
            q.finish_calibration()
    finally:
        for q in quants:
            q.calibrating = False
        model.train(was_training)
    log.info("calibrated %d activation quantizers on %d batches", len(quants), n)
    return n


# ---------------------------------------------------------------------------------------------------------------
# The scales beside a plain model dir: quantization.json (scheme, layers, groups) + quantization.safetensors.


def scales_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per layer: weight_scale (out,), and for Linear layers act_scale and act_zero_point (scalars)."""
    state: dict[str, torch.Tensor] = {}
    for name, m in quant_layers(model).items():
        state[f"{name}.weight_scale"] = weight_scale(m.weight, m.w_max).float().contiguous()
        if isinstance(m, QuantLinear):
            state[f"{name}.act_scale"] = m.act.scale().detach().float().reshape(()).clone()
            state[f"{name}.act_zero_point"] = m.act.zero_point.detach().float().reshape(()).clone()
    return state


def save_scales(model: nn.Module, out: Path, cfg: FakeQuantConfig) -> dict:
    """Write quantization.json and quantization.safetensors into the model dir `out`; returns the json content."""
    from safetensors.torch import save_file

    layers = quant_layers(model)
    groups: dict[int, list[str]] = {}
    for name, m in layers.items():
        if isinstance(m, QuantLinear):
            groups.setdefault(id(m.act), []).append(name)
    w_max = next((m.w_max for m in layers.values()), W_MAX)
    info = {
        "format": FORMAT,
        "weights": {"dtype": "int8", "scheme": "symmetric, per output channel", "range": [-w_max, w_max]},
        "activations": {"dtype": "uint8", "scheme": "per tensor, zero point 128 (signed) or 0", "mode": cfg.act_scale},
        "config": asdict(cfg),
        "layers": {n: "embedding" if isinstance(m, QuantEmbedding) else "linear" for n, m in layers.items()},
        "shared_inputs": [g for g in groups.values() if len(g) > 1],
        "kept_fp32": kept_fp32(model),
    }
    save_file(scales_state(model), str(out / SCALES_FILE), metadata={"format": FORMAT})
    (out / SCALES_JSON).write_text(json.dumps(info, indent=2) + "\n")
    return info


def kept_fp32(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)


def load_fake_quant(path: str | Path, model: nn.Module) -> nn.Module:
    """Prepare `model` (loaded from the QAT dir `path`) as recorded there and load the learned scales; eval mode."""
    from t5compress.model.weights import load_safetensors

    path = Path(path)
    try:
        info = json.loads((path / SCALES_JSON).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the quantization scales in '{path}': {e}") from None
    state = load_safetensors(path / SCALES_FILE)
    if info.get("format") != FORMAT:
        raise ModelError(f"'{path / SCALES_JSON}' is not a {FORMAT} scales file (format {info.get('format')!r})")
    cfg = FakeQuantConfig(**info["config"])
    prepare(model, cfg, w_max=int(info["weights"]["range"][1]))  # as trained, whatever this CPU is
    layers = quant_layers(model)
    if set(layers) != set(info["layers"]):
        raise ModelError(f"'{path / SCALES_JSON}' lists other layers than the model has: rerun qat")
    with torch.no_grad():
        for name, m in layers.items():
            if isinstance(m, QuantLinear):
                m.act.set_scale(state[f"{name}.act_scale"])
                m.act.zero_point.copy_(state[f"{name}.act_zero_point"])
    return model.eval()


def summarize(model: nn.Module) -> dict:
    """Counts and ranges of the scales, for report.json."""
    quants = act_quantizers(model)
    scales = [float(q.scale().detach()) for q in quants]
    layers = quant_layers(model)
    return {
        "quantized_linear": sum(isinstance(m, QuantLinear) for m in layers.values()),
        "quantized_embedding": sum(isinstance(m, QuantEmbedding) for m in layers.values()),
        "activation_quantizers": len(quants),
        "unsigned_inputs": sum(float(q.zero_point) == 0 for q in quants),
        "act_scale_min": min(scales, default=None),
        "act_scale_max": max(scales, default=None),
        "kept_fp32": kept_fp32(model),
    }

