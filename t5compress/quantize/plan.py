"""The `auto` choices of a quantize run, resolved once from the config and the model (see `modes.Method.resolve`):
printed before the work starts and recorded in report.json under "plan"."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

KEEP_AUTO, KEEP_NONE, KEEP_SENSITIVE = "auto", "none", "sensitive"
PER_TOKEN_AUTO, PER_TOKEN_NONE = "auto", "none"
AUTO_ALPHA = 0.5  # SmoothQuant's own default; on two trained gated fixtures 0.5, 0.7 and 0.85 did alike
GPTQ, NEAREST = "gptq", "nearest"
ROUNDINGS = (GPTQ, NEAREST)

# what `keep_fp32` resolves to besides name parts
KEEP_WO = "wo"  # T5's FFN outputs (gated models without per-token int8 or smoothing: their inputs have outliers)
KEEP_MEASURED = "measured"  # the sensitivity search decides
# what a 4-bit model keeps 8-bit (`keep_8bit`), besides name parts
WIDE_AUTO, WIDE_NONE = "auto", "none"
# what `sensitivity` resolves to
OFF, IF_NEEDED, EVERY_GROUP = "off", "if needed", "every group"


class Remedy(StrEnum):
    """What the search chose before keeping any group fp32 (the report's `remedy.chosen`)."""

    PER_TOKEN = "per-token int8"  # the linear layers are per-token int8: their outputs stay fp32 already
    OUTPUTS_INT8 = "linear outputs int8"
    OUTPUTS_FP32 = "linear outputs fp32"  # int8 weights and inputs, as dynamic int8 has them


@dataclass(frozen=True)
class QuantPlan:
    """What this run does, every `auto` decided."""

    mode: str
    gated: bool  # a gated-gelu FFN (T5 v1.1 / Flan): outliers in `wo`'s inputs
    tied: bool  # the LM head shares the token embedding's matrix (T5 v1.0)
    weight_max: int  # 127, or 63 for x86 CPUs whose int8 kernels saturate (`--weight-range`)
    smooth_alpha: float  # SmoothQuant's migration strength (0: no smoothing)
    per_token: str  # linear layers per-token int8: none, auto (every linear layer of a gated model), or name parts
    keep_fp32: str  # none, wo, measured (the sensitivity search decides), or name parts
    sensitivity: str  # off, if needed (all int8 misses the target), every group
    rounding: str  # how per-token / block-wise weights are rounded: gptq, nearest, or "" where nothing is
    block_size: int = 0  # block-wise: input channels per scale
    row_lookups: bool = False  # static: untied embedding lookups gather int8 rows, a scale each
    share_table: bool = False  # a tied table is stored once, in the LM head's int8 matrix
    tune: bool = False  # onnx-neural-compressor's accuracy-aware tuning picks the fp32 nodes
    bits: int = 8  # weight bits of the block-wise layers
    keep_8bit: str = ""  # 4-bit: name parts of the nodes kept 8-bit ("": none)

    def describe(self) -> str:
        """One line: the choices that shape the int8 model."""
        parts = [self.mode, f"weights +-{self.weight_max}"]
        if self.smooth_alpha:
            parts.append(f"SmoothQuant alpha {self.smooth_alpha:g}")
        if self.per_token != PER_TOKEN_NONE:
            parts.append(f"per-token: {self.per_token}")
        if self.keep_fp32 != KEEP_NONE:
            parts.append(f"kept fp32: {self.keep_fp32}")
        if self.sensitivity != OFF:
            parts.append(f"sensitivity: {self.sensitivity}")
        if self.rounding:
            parts.append(f"rounding: {self.rounding}")
        if self.block_size:
            parts.append(f"blocks of {self.block_size}")
        if self.bits != 8:
            parts.append(f"{self.bits}-bit weights" + (f", 8-bit: {self.keep_8bit}" if self.keep_8bit else ""))
        if self.tune:
            parts.append("tuned by onnx-neural-compressor")
        return ", ".join(parts)
