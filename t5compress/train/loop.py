"""The shared training loop: fine-tuning, and later QAT, recovery after pruning and distillation, all run through it.

It works unchanged on one CPU, one GPU, or several GPUs under `accelerate launch` (DDP: each process takes every
world_size-th batch; checkpoints and evaluation happen on the main process).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from t5compress.config import choose, option, require
from t5compress.data import Encoded, Example, batch_order, collate
from t5compress.errors import ConfigError
from t5compress.progress import Reporter, first_step_cost, memory_total, peak_rss

log = logging.getLogger(__name__)


def _adamw(params, cfg):
    import torch

    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _adafactor(params, cfg):
    from transformers.optimization import Adafactor

    # External learning rate (the schedule below drives it), as in T5 fine-tuning recipes.
    return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, relative_step=False, scale_parameter=False)


def _adamwscale(params, cfg):
    from t5compress.train.optim import AdamWScale

    return AdamWScale(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


OPTIMIZERS: dict[str, Callable] = {"adamw": _adamw, "adafactor": _adafactor, "adamwscale": _adamwscale}


def _cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _inverse_sqrt(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return math.sqrt(max(warmup, 1)) / math.sqrt(max(step, warmup, 1))


def _constant(step: int, warmup: int, total: int) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


SCHEDULES: dict[str, Callable[[int, int, int], float]] = {
    "cosine": _cosine,
    "inverse_sqrt": _inverse_sqrt,
    "constant": _constant,
}
PRECISIONS = ("auto", "fp32", "bf16")
BEST_METRICS = ("loss", "exact_match", "rougeL", "bleu")
TRAIN_COST_OPTIONS = "--batch-size, --max-steps, --max-source-length"  # what makes a fine-tuning run cheaper


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = option(0, "Optimizer steps to run; 0 means --epochs passes over the training data.")
    epochs: int = option(3, "Passes over the training data when --max-steps is 0.")
    batch_size: int = option(16, "Examples per batch (per process).")
    grad_accum: int = option(1, "Batches accumulated per optimizer step.")
    optimizer: str = option("adamw", "Optimizer: adamw, adafactor or adamwscale (AdamW with RMS-scaled steps).")
    lr: float = option(5e-4, "Peak learning rate.")
    weight_decay: float = option(0.0, "Weight decay.")
    schedule: str = option("cosine", "Learning-rate schedule after warm-up: cosine, inverse_sqrt or constant.")
    warmup_steps: int = option(-1, "Linear warm-up steps; -1 means 5% of the run.")
    label_smoothing: float = option(0.0, "Label smoothing of the cross-entropy loss.")
    max_grad_norm: float = option(1.0, "Clip the gradient norm to this value; 0 disables clipping.")
    precision: str = option("auto", "auto (bf16 where the GPU supports it, else fp32), fp32 or bf16.")
    eval_every: int = option(200, "Evaluate every N optimizer steps (0: only at the end).")
    eval_max_examples: int = option(500, "Evaluate on at most this many held-out examples.")
    eval_batch_size: int = option(32, "Batch size for evaluation and generation.")
    eval_num_beams: int = option(1, "Beams used to generate during evaluation.")
    eval_max_new_tokens: int = option(0, "Max generated tokens in evaluation; 0 means the data's max target length.")
    metric: str = option("rougeL", "Metric that picks the best checkpoint: loss, exact_match, rougeL or bleu.")
    patience: int = option(0, "Stop after this many evaluations without improvement (0: no early stopping).")
    save_every: int = option(0, "Write a resumable checkpoint every N steps; 0 means at every evaluation.")
    bucket: bool = option(True, "Batch examples of similar length together (less padding).")
    compile: bool = option(False, "torch.compile the training forward pass (falls back to eager where it fails).")
    seed: int = option(0, "Random seed (initialisation, data order, dropout).")

    def __post_init__(self) -> None:
        require(self.max_steps >= 0, "max_steps", "must be >= 0")
        require(self.epochs > 0 or self.max_steps > 0, "epochs", "must be > 0 when max_steps is 0")
        require(self.batch_size > 0, "batch_size", "must be > 0")
        require(self.grad_accum > 0, "grad_accum", "must be > 0")
        require(self.lr > 0, "lr", "must be > 0")
        require(0 <= self.label_smoothing < 1, "label_smoothing", "must be in [0, 1)")
        require(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
        require(self.eval_every >= 0 and self.save_every >= 0, "eval_every", "must be >= 0")
        require(self.patience >= 0, "patience", "must be >= 0")
        require(self.precision in PRECISIONS, "precision", f"choose one of {', '.join(PRECISIONS)}")
        require(self.metric in BEST_METRICS, "metric", f"choose one of {', '.join(BEST_METRICS)}")
        choose(OPTIMIZERS, self.optimizer, "optimizer")
        choose(SCHEDULES, self.schedule, "schedule")


@dataclass
class EvalSet:
    examples: list[Example]
    encoded: Encoded
    max_new_tokens: int

    def evaluate(self, model, tokenizer, cfg: TrainConfig, device) -> dict:
        """Loss on the references and generation metrics (see `t5compress.train.evaluation.evaluate`)."""
        from t5compress.train.evaluation import evaluate

        return evaluate(model, tokenizer, self.examples, self.encoded, cfg.eval_batch_size, self.max_new_tokens,
                        cfg.eval_num_beams, device=device)


class Evaluator(Protocol):
    """Held-out evaluation: a dict holding at least `cfg.metric` (EvalSet, or pre-training's span-corruption loss)."""

    def evaluate(self, model, tokenizer, cfg: TrainConfig, device) -> dict: ...


class BatchStream(Protocol):
    """Training batches from somewhere other than an in-memory `Encoded` (e.g. a streamed, packed corpus).

    `batches(epoch, pos, rank, world)` yields (epoch, position after this batch, batch of CPU tensors, examples)
    forever, deterministically, starting after batch `pos` of `epoch`: that is what makes a run resumable.
    """

    def batches(self, epoch: int, pos: int, rank: int, world: int) -> Iterator[tuple[int, int, dict, int]]: ...


def total_steps(cfg: TrainConfig, n_examples: int | None, world: int = 1) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    if n_examples is None:
        raise ConfigError("max_steps: a streamed training set has no epochs; give --max-steps")
    batches = math.ceil(n_examples / cfg.batch_size) // world
    return max(1, cfg.epochs * max(1, batches // cfg.grad_accum))


def _batches(train: Encoded, cfg: TrainConfig, epoch: int, pos: int, rank: int, world: int, pad: int
             ) -> Iterator[tuple]:
    """Endless (epoch, position, batch, examples) stream, deterministic in (seed, epoch), resumable at (epoch, pos)."""
    lengths = [len(x) for x in train.input_ids]
    while True:
        order = batch_order(lengths, cfg.batch_size, seed=cfg.seed, epoch=epoch, bucket=cfg.bucket)
        order = order[: len(order) // world * world][rank::world] if world > 1 else order
        for i in range(pos, len(order)):
            yield epoch, i + 1, collate(train, order[i], pad), len(order[i])
        epoch, pos = epoch + 1, 0


def _compiled(model, cfg: TrainConfig):
    """The module the training steps call: `torch.compile(model)` when asked for (weights stay shared)."""
    import torch

    if not cfg.compile:
        return model
    try:
        return torch.compile(model)
    except Exception as e:  # noqa: BLE001 - any backend failure means: train eagerly
        log.warning("torch.compile is not available here (%s); training eagerly", e)
        return model


def _mixed_precision(cfg: TrainConfig) -> str:
    import torch

    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_ok):
        return "bf16"
    return "no"


def _accelerator(mixed_precision: str):
    """An Accelerator with this run's precision. accelerate keeps one process-wide state and refuses another
    precision later in the same process (a bf16 pre-training then an fp32 fine-tune): start that state afresh,
    keeping the process group (PartialState) as it is."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state and AcceleratorState._shared_state.get("_mixed_precision") != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(mixed_precision=mixed_precision)


def _count_tokens(batch: dict) -> int:
    """Tokens the step trained on: input tokens that are not padding plus target tokens that are not ignored."""
    inputs = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
    return int(inputs) + int((batch["labels"] != -100).sum())


def _is_better(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value < best if metric == "loss" else value > best


@dataclass
class _Run:
    """One training run set up: the accelerator, the prepared model and optimiser, the batches, the counters."""

    acc: Any
    model: Any
    forward: Any  # the compiled model, or the model itself once compilation failed
    optimizer: Any
    scheduler: Any
    stream: Iterator
    state: dict
    steps: int
    warmup: int
    seen: int = 0
    tokens: int = 0


def fit(
    model,
    tokenizer,
    train: Encoded | BatchStream,
    evalset: Evaluator | None,
    cfg: TrainConfig,
    workdir: Path,
    resume: bool = False,
    loss_fn: Callable | None = None,
    progress: bool = True,
    on_step: Callable[[dict], None] | None = None,
    label: str = "train",
    lower_with: str = TRAIN_COST_OPTIONS,
) -> dict:
    """Train `model` in place; checkpoints go to `workdir`. Returns the training summary and evaluation history.

    `label` names the run in its progress lines; `lower_with` names the options that make it cheaper, said after the
    first step when the run looks long or memory-heavy for this machine.
    """
    from t5compress.train import checkpoint as ckpt
    from t5compress.train.evaluation import token_loss

    loss_fn = loss_fn or token_loss
    run = _start(model, tokenizer, train, cfg, workdir, resume)
    acc, state = run.acc, run.state
    save_every = cfg.save_every or cfg.eval_every or run.steps
    t0, start_step = time.perf_counter(), state["step"]
    with Reporter(label, run.steps, state["step"], unit="step", enabled=progress and acc.is_main_process) as bar:
        while state["step"] < run.steps:
            t_step = time.perf_counter()
            loss_sum = _step(run, cfg, loss_fn)
            step, lr = state["step"], run.scheduler.get_last_lr()[0]
            if step == start_step + 1 and acc.is_main_process:
                _first_step_cost(run, time.perf_counter() - t_step, bar, label, lower_with)
            elapsed = time.perf_counter() - t0
            bar.update(info=_step_info(loss_sum, lr, run.seen * acc.num_processes / elapsed,
                                       run.tokens * acc.num_processes / elapsed))
            stop = False
            if evalset is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == run.steps):
                stop = _evaluate(acc, run.model, tokenizer, evalset, cfg, state, workdir, lr)
                if acc.is_main_process:
                    bar.note(_eval_note(state["history"][-1]))
            if acc.is_main_process and (step % save_every == 0 or stop or step == run.steps):
                ckpt.save_checkpoint(workdir, acc.unwrap_model(run.model), run.optimizer, run.scheduler, state)
            acc.wait_for_everyone()
            if on_step is not None:
                on_step(state)
            if stop:
                log.info("early stopping at step %d: no improvement in %d evaluations", step, cfg.patience)
                break
    return _summary(run, cfg, time.perf_counter() - t0, start_step if resume else None)


def _step_info(loss: float, lr: float, rate: float, token_rate: float) -> str:
    return f"loss {loss:.4g} lr {lr:.1e} {rate:.1f} ex/s {token_rate:,.0f} tok/s"


def _eval_note(entry: dict) -> str:
    shown = {k: entry[k] for k in ("step", "loss", "exact_match", "rougeL", "bleu") if k in entry}
    return "eval " + "  ".join(f"{k} {v}" for k, v in shown.items())


def _first_step_cost(run: _Run, seconds: float, bar: Reporter, label: str, lower_with: str) -> None:
    """Say what the run will cost here, measured on its first step: a warning when it is long or memory-heavy."""
    import torch

    gpu = None
    if run.acc.device.type == "cuda":
        gpu = (torch.cuda.max_memory_allocated(run.acc.device),
               torch.cuda.get_device_properties(run.acc.device).total_memory)
    steps = run.steps - run.state["step"] + 1
    text, heavy = first_step_cost(seconds, steps, peak_rss(), memory_total(), gpu)
    if heavy:
        log.warning("%s is long or memory-heavy for this machine: %s (the first step includes warm-up); "
                    "lower it with %s", label, text, lower_with)
    else:
        bar.note(text)


def _start(model, tokenizer, train: Encoded | BatchStream, cfg: TrainConfig, workdir: Path, resume: bool) -> _Run:
    """Accelerator, optimiser, schedule and batches, from the last checkpoint when resuming."""
    import torch

    from t5compress.train import checkpoint as ckpt

    acc = _accelerator(_mixed_precision(cfg))
    torch.manual_seed(cfg.seed)
    n_train = len(train.input_ids) if isinstance(train, Encoded) else None
    steps = total_steps(cfg, n_train, acc.num_processes)
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, steps // 20)
    optimizer = OPTIMIZERS[cfg.optimizer](model.parameters(), cfg)
    schedule = SCHEDULES[cfg.schedule]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, warmup, steps))
    state = {"step": 0, "epoch": 0, "pos": 0, "best": None, "best_step": None, "bad_evals": 0, "history": []}
    if resume and (saved := ckpt.load_checkpoint(workdir, model, optimizer, scheduler)) is not None:
        state = saved
        log.info("resuming at step %d (epoch %d, batch %d)", state["step"], state["epoch"], state["pos"])
    model, optimizer = acc.prepare(model, optimizer)
    where = (state["epoch"], state["pos"], acc.process_index, acc.num_processes)
    pad = tokenizer.pad_token_id
    stream = _batches(train, cfg, *where, pad) if isinstance(train, Encoded) else train.batches(*where)
    return _Run(acc, model, _compiled(model, cfg), optimizer, scheduler, stream, state, steps, warmup)


def _step(run: _Run, cfg: TrainConfig, loss_fn: Callable) -> float:
    """One optimiser step over `grad_accum` batches; returns its loss."""
    acc = run.acc
    run.model.train()
    loss_sum = 0.0
    for _ in range(cfg.grad_accum):
        epoch, pos, cpu_batch, n_examples = next(run.stream)
        batch = {k: v.to(acc.device) for k, v in cpu_batch.items()}
        try:
            with acc.autocast():
                loss = loss_fn(run.forward, batch, cfg.label_smoothing) / cfg.grad_accum
        except Exception as e:  # noqa: BLE001 - torch.compile fails on first call where it cannot work
            if run.forward is run.model:
                raise
            log.warning("torch.compile failed (%s); training eagerly", str(e).splitlines()[0] if str(e) else e)
            run.forward = run.model
            with acc.autocast():
                loss = loss_fn(run.forward, batch, cfg.label_smoothing) / cfg.grad_accum
        acc.backward(loss)
        loss_sum += float(loss.detach())
        run.seen += n_examples
        run.tokens += _count_tokens(cpu_batch)
    if cfg.max_grad_norm:
        acc.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.update(step=run.state["step"] + 1, epoch=epoch, pos=pos, loss=round(loss_sum, 5))
    return loss_sum


def _summary(run: _Run, cfg: TrainConfig, elapsed: float, resumed_from: int | None) -> dict:
    state, n = run.state, run.acc.num_processes
    return {
        "steps": state["step"],
        "planned_steps": run.steps,
        "warmup_steps": run.warmup,
        "stopped_early": state["step"] < run.steps,
        "final_train_loss": state.get("loss"),
        "best_step": state["best_step"],
        "best_" + cfg.metric: state["best"],
        "seconds": round(elapsed, 1),
        "examples_per_second": round(run.seen * n / max(elapsed, 1e-9), 1),
        "tokens_per_second": round(run.tokens * n / max(elapsed, 1e-9), 1),
        "resumed_from_step": resumed_from,
        "history": state["history"],
    }


def _evaluate(
    acc, model, tokenizer, evalset: EvalSet, cfg: TrainConfig, state: dict, workdir: Path, lr: float
) -> bool:
    """Evaluate on the main process, keep the best weights, and agree across processes on early stopping."""
    import torch

    from t5compress.train import checkpoint as ckpt

    stop = False
    if acc.is_main_process:
        inner = acc.unwrap_model(model)
        result = evalset.evaluate(inner, tokenizer, cfg, acc.device)
        entry = {"step": state["step"], "train_loss": state.get("loss"), "lr": lr}
        entry.update({k: v for k, v in result.items() if k != "samples"})
        state["history"].append(entry)
        value = result[cfg.metric]
        if _is_better(cfg.metric, value, state["best"]):
            state.update(best=value, best_step=state["step"], bad_evals=0)
            ckpt.save_best(workdir, inner, {"step": state["step"], **result})
        else:
            state["bad_evals"] += 1
        stop = bool(cfg.patience) and state["bad_evals"] >= cfg.patience
    if acc.num_processes > 1:
        flag = acc.reduce(torch.tensor([int(stop)], device=acc.device), reduction="sum")
        stop = bool(flag.item())
    return stop
