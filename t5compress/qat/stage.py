"""The `qat` stage: fine-tune with int8 fake quantization through the same trainer as `train`.

    report = run("model-dir", QatConfig(FinetuneConfig(train_data="train.jsonl")), "qat-dir")

The output is a plain Hugging Face model dir (fp32 weights, `from_pretrained` loads it with no t5compress code) with
the learned int8 scales beside it (`quantization.json`, `quantization.safetensors`); `t5compress export --onnx` of it
writes QuantizeLinear/DequantizeLinear graphs carrying those scales. Resumable after a kill like `train` (`--resume`).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from t5compress import artifacts
from t5compress.data import batch_order, collate
from t5compress.qat.fakequant import (
    QuantEmbedding,
    QuantLinear,
    calibrate,
    prepare,
    quant_layers,
    save_scales,
    strip,
    summarize,
)
from t5compress.qat.scheme import FakeQuantConfig
from t5compress.train.stage import FinetuneConfig, Session, fit_session, open_session

log = logging.getLogger(__name__)
METRICS = ("loss", "exact_match", "rougeL", "bleu")


@dataclass(frozen=True)
class QatConfig:
    finetune: FinetuneConfig = field(metadata={"help": "Data and optimisation settings, as for train."})
    quant: FakeQuantConfig = field(default_factory=FakeQuantConfig, metadata={"help": "Fake-quantization scheme."})


def run(
    src: str, cfg: QatConfig, out: str | Path, *, force: bool = False, progress: bool = True,
    resume: bool = False, on_step=None,
) -> artifacts.Report:
    """Quantization-aware fine-tuning of `src`; writes the best model and its scales to `out`. Returns the report."""
    with artifacts.envelope("qat", src, cfg, out, force=force) as env:
        s = open_session(src, cfg.finetune, env.out, force, resume, record=cfg, stage="qat")
        fp32_start = _evaluate(s, cfg) if s.is_main else None
        prepare(s.model, cfg.quant)
        calibrate(s.model, _calibration_batches(s, cfg))
        calibrated = _evaluate(s, cfg) if s.is_main else None
        result = fit_session(s, cfg.finetune, resume, progress, on_step, label="qat")
        if not s.is_main:
            return {"stage": "qat", **result}
        sizes = weight_bytes(s.model)
        scales = summarize(s.model)
        from t5compress.model.load import describe, save_model_dir

        with env.staging() as tmp:
            quant_info = save_scales(s.model, tmp, cfg.quant)
            strip(s.model)
            fp32_end = _evaluate(s, cfg)  # the same weights without fake quantization: what plain HF loading gives
            report = {
                "stage": "qat",
                "model": describe(s.model),
                "data": s.data_report,
                "train": result["train"],
                "eval": result["eval"],
                "metrics": {"fp32_start": fp32_start, "int8_calibrated": calibrated,
                            "int8_qat": _metrics(result["eval"]), "fp32_after_qat": fp32_end},
                "sizes": sizes,
                "scales": scales,
                "quantization": {k: quant_info[k] for k in ("weights", "activations", "shared_inputs")},
            }
            save_model_dir(s.model, s.tokenizer, tmp)
            report["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            env.report = report
        shutil.rmtree(s.work, ignore_errors=True)
        return report


def _calibration_batches(s: Session, cfg: QatConfig):
    """The first `calib_batches` training batches, in the trainer's own order (deterministic in the seed)."""
    t = cfg.finetune.train
    lengths = [len(x) for x in s.train.input_ids]
    order = batch_order(lengths, t.batch_size, seed=t.seed, epoch=0, bucket=t.bucket)
    for idx in order[: cfg.quant.calib_batches]:
        yield collate(s.train, idx, s.tokenizer.pad_token_id)


def _metrics(result: dict | None) -> dict | None:
    return None if result is None else {k: result[k] for k in METRICS if k in result}


def _evaluate(s: Session, cfg: QatConfig) -> dict:
    from t5compress.train.evaluation import evaluate

    t = cfg.finetune.train
    result = evaluate(s.model, s.tokenizer, s.evalset.examples, s.evalset.encoded, t.eval_batch_size,
                      s.evalset.max_new_tokens, t.eval_num_beams)
    return _metrics(result)


def weight_bytes(model) -> dict:
    """Bytes of the weights in fp32, and as the int8 export stores them (int8 values + fp32 per-channel scales)."""
    quantized = {id(m.weight): m.weight for m in quant_layers(model).values()
                 if isinstance(m, QuantLinear | QuantEmbedding)}
    unique = {id(p): p for p in model.parameters() if p.ndim > 0}
    fp32 = sum(p.numel() * 4 for p in unique.values())
    int8 = sum(p.numel() + 4 * p.shape[0] if k in quantized else p.numel() * 4 for k, p in unique.items())
    return {"fp32_weight_bytes": fp32, "int8_weight_bytes": int8, "ratio": round(int8 / fp32, 4)}
