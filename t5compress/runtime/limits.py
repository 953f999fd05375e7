"""How much memory a generation call needs, checked before anything is allocated.

Every buffer the runtime sizes from the caller's numbers (input length, max_new_tokens, beams, batch) is sized here
first: the encoder's attention is quadratic in the input length (a 100k-token input asks ONNX Runtime for hundreds of
GB), and the search holds (batch, beams, 1 + max_new_tokens) token arrays (max_new_tokens = 10**12 asks numpy for
TiBs). A call that cannot fit in the memory available is refused with one line giving the number asked for and the
largest that fits, instead of an allocation error from deep inside ONNX Runtime or numpy.

The estimate is deliberately rough (fp32 everywhere, the larger intermediates only): it is meant to tell 100 GB from
1 GB, not to plan memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from t5compress.errors import ConfigError, DataError, ModelError

FLOAT = 4  # bytes per activation (fp16 exports use less: the estimate errs high)
TOKEN = 8  # int64 token ids


@dataclass(frozen=True)
class ModelShape:
    """The sizes of an export that decide its memory per token (from its config.json)."""

    heads: int
    d_kv: int
    d_model: int
    d_ff: int
    decoder_layers: int
    vocab: int

    @classmethod
    def read(cls, path: Path) -> ModelShape | None:
        """The shape from `path/config.json`; None when it is missing or lacks a size (no check is made then)."""
        try:
            c = json.loads((path / "config.json").read_text())
            return cls(int(c["num_heads"]), int(c["d_kv"]), int(c["d_model"]), int(c["d_ff"]),
                       int(c.get("num_decoder_layers") or c["num_layers"]), int(c["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def generation_bytes(m: ModelShape, batch: int, beams: int, input_len: int, max_new: int) -> int:
    """About the peak memory of one generate call: encoder attention, the KV caches, the search's arrays."""
    rows, out_len = batch * beams, max_new + 1
    attention = (2 * batch + 1) * m.heads * input_len * input_len * FLOAT  # scores, softmax; position bias once
    encoder = 4 * batch * input_len * max(m.d_model, m.d_ff) * FLOAT
    cache = 2 * rows * m.decoder_layers * 2 * m.heads * m.d_kv * (input_len + out_len) * FLOAT  # in and out of a step
    tokens = rows * out_len * TOKEN * (7 if beams > 1 else 1)  # beam search: live, candidate and finished copies
    logits = 3 * rows * m.vocab * FLOAT
    return attention + encoder + cache + tokens + logits


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable (or free pages), capped by a cgroup v2 limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def check_fits(m: ModelShape | None, batch: int, beams: int, input_len: int, max_new: int,
               available: int | None = None) -> None:
    """Refuse a call whose buffers cannot fit: DataError for the input's length, ConfigError for max_new_tokens."""
    if m is None:
        return
    need = generation_bytes(m, batch, beams, input_len, max_new)
    available = available_memory() if available is None else available
    if available is None or need <= available:
        return
    what = f"(batch {batch}, {beams} beam{'s' if beams > 1 else ''})"
    have = f"{_size(available)} is available"
    if generation_bytes(m, batch, beams, input_len, 1) > available:  # the input alone is too long
        fits = _largest(lambda n: generation_bytes(m, batch, beams, n, 1) <= available, input_len)
        hint = (f"at most {fits:,} input tokens fit: set max_input_tokens to {fits} or less (it truncates)" if fits
                else "not even one token fits: lower the batch size or the beams")
        raise DataError(f"an input of {input_len:,} tokens {what} needs about {_size(need)} to encode, {have}; {hint}")
    fits = _largest(lambda n: generation_bytes(m, batch, beams, input_len, n) <= available, max_new)
    raise ConfigError(f"max_new_tokens: {max_new:,} new tokens {what} need about {_size(need)}, {have}; at most "
                      f"{fits:,} fit")


def parameters(config: dict) -> int:
    """About the parameter count of a T5 config: the embedding (and the LM head when untied), attention, FFN, norms."""
    d, ff = int(config["d_model"]), int(config["d_ff"])
    inner = int(config["num_heads"]) * int(config["d_kv"])
    enc = int(config["num_layers"])
    dec = int(config.get("num_decoder_layers") or enc)
    ffn = (3 if str(config.get("feed_forward_proj", "relu")).startswith("gated") else 2) * d * ff
    embeddings = int(config["vocab_size"]) * d * (1 if config.get("tie_word_embeddings", True) else 2)
    return embeddings + enc * (4 * d * inner + ffn + 2 * d) + dec * (8 * d * inner + ffn + 3 * d)


# Peak resident memory of a stage: a fixed part (the interpreter, torch or ONNX Runtime, working buffers) plus a
# multiple of the fp32 weights, measured on t5-base (benchmarks/results/current/scale/) and t5-large (export, 9.1 GB)
# shapes.
STAGE_MEMORY = {
    "export": (1.5 * 2**30, 3.3),  # the PyTorch model, its traced copy, the ONNX graphs and their check
    # the graphs run once while calibrating (t5-base, static int8 on 512-token texts: 3.5 GB); GPTQ's X^T X comes
    # on top where weights are GPTQ-rounded (`gram_bytes`; flan-t5-large, static int8: 16.2 GiB in all)
    "quantize": (0.5 * 2**30, 3.5),
}
# Stages that train hold the weights, their gradients and AdamW's two moments (4x), and, through the backward pass,
# the activations (`activation_bytes`, which `check_model_fits` adds where they outgrow the moments); pruning with
# distilled recovery also a teacher (flan-t5-large, prune 50/50 and 4 recovery steps at batch 2: 14.2 GiB, 4.5x).
STAGE_MEMORY.update({stage: (1.5 * 2**30, 4.0) for stage in ("train", "qat", "pretrain")})
STAGE_MEMORY.update({stage: (1.5 * 2**30, 4.5) for stage in ("prune", "recover")})


def gram_bytes(config: dict) -> int:
    """GPTQ's X^T X (float32, d_in^2 for each distinct linear input), all held until a graph's pass ends, in the
    encoder and the decoders (the two decoder graphs sum into one per layer, `gptq.gram_meters`): encoder blocks read
    d_model (q, k, v; wi), inner (o) and d_ff (wo); decoder blocks also their cross-attention's (flan-t5-large:
    2.3 GiB)."""
    d, ff = int(config["d_model"]), int(config["d_ff"])
    inner = int(config["num_heads"]) * int(config["d_kv"])
    enc = int(config["num_layers"])
    dec = int(config.get("num_decoder_layers") or enc)
    square = 4 * (d * d), 4 * (inner * inner), 4 * (ff * ff)
    encoder = enc * (2 * square[0] + square[1] + square[2])
    decoder = dec * (4 * square[0] + 2 * square[1] + square[2]) + square[0]  # + the LM head's input
    return encoder + decoder


def activation_bytes(config: dict, batch: int, source: int, target: int) -> int:
    """What training keeps for the backward pass, fp32 without recomputation, for batches of `source`-token inputs
    and `target`-token labels. Per layer and token, after Korthikanti et al. 2022 (doubled for fp32): about 13
    d_model for attention and norms (x1.5 in the decoder, which also attends across), 2 + 4.75 d_ff/d_model for the
    FFN (x1.5 gated), 5 per head and attended token; and the logits three times; all x1.3, what `t5compress train`
    of a t5-base shape (512 -> 64 tokens) measured: 0.98 GiB more peak memory per example of the batch."""
    d, ff, heads = int(config["d_model"]), int(config["d_ff"]), int(config["num_heads"])
    enc = int(config["num_layers"])
    dec = int(config.get("num_decoder_layers") or enc)
    ffn = 2 + 4.75 * ff / d * (1.5 if str(config.get("feed_forward_proj", "relu")).startswith("gated") else 1)
    encoder = source * (13 + ffn) * d + 5 * heads * source * source
    decoder = target * (13 * 1.5 + ffn) * d + 5 * heads * target * (target + source)
    logits = 3 * target * int(config["vocab_size"])
    return int(1.3 * batch * (2 * (enc * encoder + dec * decoder) + FLOAT * logits))  # the counts are fp16 bytes


def check_stage_fits(stage: str, config_file: Path, name: str, available: int | None = None,
                     extra: Callable[[dict], int] | None = None,
                     lower: str = "use a machine with more memory, or a smaller model") -> None:
    """Refuse, before anything is loaded, a model whose `stage` needs more memory than this machine has available
    (one ModelError line naming both, and `lower`: how to need less); a missing or unreadable config.json is left
    to the stage's own checks. `extra(config)`: bytes this run needs beyond the stage's usual (`gram_bytes`,
    `activation_bytes`)."""
    try:
        config = json.loads(config_file.read_text())
        params = parameters(config)
        more = extra(config) if extra else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    base, factor = STAGE_MEMORY[stage]
    need = base + factor * FLOAT * params + more
    available = available_memory() if available is None else available
    if available is not None and need > available:
        raise ModelError(f"{name} ({params / 1e9:.2f}B parameters) needs about {need / 2**30:.0f} GB to {stage}; this "
                         f"machine has {available / 2**30:.1f} GB available ({lower})")


def check_model_fits(stage: str, src: str | os.PathLike, batch: tuple[int, int, int] | None = None) -> None:
    """`check_stage_fits` for the model dir `src` (a hub id is not checked: its config is not here before loading);
    `batch`: (examples, source tokens, target tokens) of the largest training batch, whose activations count too."""
    if not Path(src).is_dir():
        return
    if batch is None:
        check_stage_fits(stage, Path(src) / "config.json", f"'{src}'")
    else:
        def beyond_moments(c: dict) -> int:  # the peak is the optimizer's step or the backward pass, the larger
            return max(0, activation_bytes(c, *batch) - 2 * FLOAT * parameters(c))

        check_stage_fits(stage, Path(src) / "config.json", f"'{src}'", extra=beyond_moments,
                         lower=f"at batch {batch[0]} of {batch[1]} -> {batch[2]} tokens: lower --batch-size (raise "
                               "--grad-accum to keep the step) or --max-source-length, or use a smaller model")


def release_memory() -> None:
    """Collect, then hand freed heap memory back to the system (`hugepages.trim_heap`: glibc keeps it otherwise;
    after calibrating a t5-base shape, 1.3 GB of freed buffers stayed resident into the next phase)."""
    import gc

    from t5compress.runtime.hugepages import trim_heap

    gc.collect()
    trim_heap()


def _largest(fits, upper: int) -> int:
    """The largest n in [0, upper] with fits(n) (fits is monotone: true up to some n)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} EiB"
