"""The QAT scheme's choices and file names, torch-free (the CLI imports them at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from t5compress.config import choose, option, require
from t5compress.cpu import WEIGHT_RANGES
from t5compress.kinds import SCALES_JSON  # noqa: F401 -- the file name, where QAT code reads it

SCALES_FILE = "quantization.safetensors"
FORMAT = "t5compress-qat-int8"
KEEP_WO = ("auto", "yes", "no")


@dataclass(frozen=True)
class ActMode:
    help: str
    learned: bool


ACT_MODES: dict[str, ActMode] = {
    "lsq": ActMode("learned step size: the scale is a parameter trained with the weights (LSQ)", learned=True),
    "ema": ActMode("exponential moving average of each training batch's range", learned=False),
}


@dataclass(frozen=True)
class FakeQuantConfig:
    act_scale: str = option("lsq", "Activation scales after calibration: lsq (learned) or ema (moving average).")
    ema_momentum: float = option(0.99, "Momentum of the ema activation scales.")
    calib_batches: int = option(8, "Training batches observed to set the initial activation scales.")
    keep_wo: str = option("auto", "Keep the FFN output projection wo in fp32: auto (gated-gelu models), yes or no.")
    lm_head: bool = option(True, "Quantize lm_head (the largest matrix, and most of the per-token time).")
    embedding: bool = option(True, "Quantize the token embedding table (per row, int8).")
    weight_range: str = option("auto", "int8 weight range: full (+-127), reduced (+-63, for x86 CPUs without VNNI, "
                                       "whose int8 kernels saturate at +-127) or auto (reduced on such CPUs).")

    def __post_init__(self) -> None:
        choose(ACT_MODES, self.act_scale, "activation scale mode")
        require(0 < self.ema_momentum < 1, "ema_momentum", f"must be in (0, 1), got {self.ema_momentum}")
        require(self.calib_batches >= 1, "calib_batches", f"must be >= 1, got {self.calib_batches}")
        require(self.keep_wo in KEEP_WO, "keep_wo", f"choose one of {', '.join(KEEP_WO)}, got {self.keep_wo!r}")
        require(self.weight_range in WEIGHT_RANGES, "weight_range",
                f"choose one of {', '.join(WEIGHT_RANGES)}, got {self.weight_range!r}")

