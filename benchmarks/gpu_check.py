"""GPU check (issue 18): fp16 exports parity-checked and timed on one GPU, beside PyTorch fp16 and CTranslate2.

Run by `benchmarks/gpu_check.sh`, which installs the gpu extra first. Per shape (random weights, real shapes:
t5-small, flan-t5-small; `tiny` is a 2+2-layer Flan-shaped model for the test suite): exports fp32 and fp16 (the
export's own fp16 check runs on the CPU), then on `--device`: the fp16 graphs against the fp32 PyTorch model
(max |diff| per graph, NaN/inf, greedy agreement), a Flan-shaped model whose fp16 `wo` overflows (finite outputs
required), and greedy and beam 4 at each batch size, 32 tokens in and exactly 32 out, for our runtime fp32, fp16 and
fp16 with IO binding (the KV cache kept on the device),
PyTorch `generate` (fp16 with wo in fp32 on CUDA, as transformers loads it; fp32 on the CPU) and CTranslate2 (fp16
on CUDA, fp32 on the CPU) when it imports. Tokens are compared with PyTorch fp32 greedy/beam on the same inputs.
Writes gpu_check.json and gpu_check.md under --out; exit 1 when a parity or NaN check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ("t5-small", "flan-t5-small")
TINY = dict(vocab_size=384, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def build(arch: str, out: Path, wo_scale: float = 1.0) -> Path:
    """A random-weight model dir of `arch` (embedding x0.3 so greedy varies), `wo` of the first layers scaled."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level

    if arch == "tiny":
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(**TINY, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                                    dropout_rate=0.0)).eval()
    else:
        model = create_model(arch, vocab_size=32128)
    with torch.no_grad():
        model.shared.weight.mul_(0.3)
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[-1].DenseReluDense.wo.weight.mul_(wo_scale)
    save_model_dir(model, byte_level(), out)
    return out


def export_both(model_dir: Path, root: Path) -> dict:
    """fp32 and fp16 exports; their report numbers (CPU parity, file sizes, seconds)."""
    from t5compress.export import ExportConfig, run

    out = {}
    for dtype in ("fp32", "fp16"):
        started = time.perf_counter()
        report = run(model_dir, ExportConfig(dtype=dtype), root / dtype, force=True, progress=False)
        parity = report["parity"]
        out[dtype] = {"dir": str(root / dtype), "seconds": round(time.perf_counter() - started, 1),
                      "onnx_bytes": sum(v for k, v in report["files"].items() if ".onnx" in k),
                      "cpu_max_abs_diff": parity["max_abs_diff"],
                      "cpu_agreement": (parity.get("token_agreement") or {}).get("agreement", 1.0)}
    out["fp16_size_ratio"] = round(out["fp16"]["onnx_bytes"] / out["fp32"]["onnx_bytes"], 3)
    return out


def device_parity(model_dir: Path, fp16_dir: Path, device: str) -> dict:
    """The fp16 graphs on `device` against the fp32 PyTorch model: max |diff| per graph, finite, agreement."""
    import torch

    from t5compress.errors import ExportError
    from t5compress.export.precision import check_half
    from t5compress.model.load import load_model
    from t5compress.names import GRAPHS, ONNX_SUFFIX
    from t5compress.runtime.device import check_session, providers_for
    from t5compress.runtime.sessions import OnnxGraph

    model = load_model(model_dir, dtype=torch.float32)
    providers = providers_for(device)
    graphs = {g: OnnxGraph(fp16_dir / f"{g}{ONNX_SUFFIX}", 0, providers) for g in GRAPHS}
    placed = check_session(graphs[GRAPHS[0]].session, device, fp16_dir)
    try:
        p = check_half(model, graphs, 0.01, 0.02, 8, f"fp16 on {placed}")
    except ExportError as e:
        return {"device": placed, "ok": False, "error": str(e)}
    worst = max(w["ratio"] for w in p["worst"].values())
    return {"device": placed, "ok": all(math.isfinite(v) for v in p["max_abs_diff"].values()),
            "max_abs_diff": p["max_abs_diff"], "worst_use_of_tolerance": round(worst, 3),
            "greedy_agreement": p["token_agreement"]["agreement"]}


def timed(fn, runs: int) -> tuple[float, float, object]:
    """(p50 ms, p90 ms, last output) over `runs` calls after one warm-up."""
    out = fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], out


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Share of tokens equal before each row's first difference (same forced length in every row)."""
    same = 0
    for g, w in zip(got, want, strict=True):
        diff = np.flatnonzero(g[: len(w)] != w[: len(g)])
        same += int(diff[0]) if diff.size else min(len(g), len(w))
    return round(same / max(want.size, 1), 4)


def engines(model_dir: Path, exports: dict, device: str) -> dict:
    """name -> generate(ids, mask, tokens, beams) -> (batch, tokens) new ids, for every engine that loads here."""
    from t5compress.runtime import load_runtime

    def ours(path, io_binding=False):
        rt = load_runtime(path, threads=0, device=device, max_input_tokens=None, io_binding=io_binding)
        return lambda ids, mask, n, beams: rt.generate(ids, mask, max_new_tokens=n, min_new_tokens=n,
                                                       num_beams=beams)[:, 1:]

    found = {"ours fp32": ours(exports["fp32"]["dir"]), "ours fp16": ours(exports["fp16"]["dir"]),
             "ours fp16 io-binding": ours(exports["fp16"]["dir"], io_binding=True),
             "ours fp16 io-binding, beams ranked on the host": host_ranked(ours(exports["fp16"]["dir"], True))}
    found.update(pytorch_engines(model_dir, device))
    try:
        found["CTranslate2"] = ctranslate2_engine(model_dir, device)
    except ImportError:
        pass
    return found


def host_ranked(generate):
    """`generate` with beam search's candidates ranked by numpy on the host (the logits copied back each step), as
    before the device-side ranking: the paired comparison for it. Greedy is the same either way."""
    from t5compress.runtime.binding import BoundDecoder

    def call(ids, mask, n, beams):
        saved = BoundDecoder.step_top
        BoundDecoder.step_top = None  # beam_search then takes the host path
        try:
            return generate(ids, mask, n, beams)
        finally:
            BoundDecoder.step_top = saved
    return call


def pytorch_engines(model_dir: Path, device: str) -> dict:
    """PyTorch fp32 (the reference tokens) and, on CUDA, fp16 as transformers loads it (wo kept fp32)."""
    import torch

    from t5compress.model.load import load_model
    from t5compress.train.evaluation import generate_kwargs

    on = "cuda" if device.startswith("cuda") else "cpu"
    dtypes = {"PyTorch fp32": torch.float32, **({"PyTorch fp16": torch.float16} if on == "cuda" else {})}
    found = {}
    for name, dtype in dtypes.items():
        model = load_model(model_dir, dtype=dtype).to(on if on == "cpu" else device)
        extra = generate_kwargs(model)

        def generate(ids, mask, n, beams, model=model, extra=extra):
            with torch.inference_mode():
                out = model.generate(input_ids=torch.from_numpy(ids).to(model.device),
                                     attention_mask=torch.from_numpy(mask).to(model.device), max_new_tokens=n,
                                     min_new_tokens=n, num_beams=beams, do_sample=False, **extra)
            if on == "cuda":
                torch.cuda.synchronize()
            return out[:, 1:].cpu().numpy()
        found[name] = generate
    return found


def ctranslate2_engine(model_dir: Path, device: str):
    """CTranslate2 fp16 on CUDA, fp32 on the CPU (tokens comparable with PyTorch fp32), converted from the model dir
    (ImportError when it is not installed)."""
    import ctranslate2

    out = model_dir.parent / "ct2"
    if not out.is_dir():
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(out), force=True)
    on, index = ("cuda", int(device.split(":")[1]) if ":" in device else 0) if device != "cpu" else ("cpu", 0)
    tr = ctranslate2.Translator(str(out), device=on, device_index=index,
                                compute_type="float16" if on == "cuda" else "float32")
    vocab = json.loads((out / "shared_vocabulary.json").read_text())
    lookup = {t: i for i, t in enumerate(vocab)}

    def generate(ids, mask, n, beams):
        tokens = [[vocab[i] for i in row[m.astype(bool)].tolist()] for row, m in zip(ids, mask, strict=True)]
        res = tr.translate_batch(tokens, beam_size=beams, max_decoding_length=n, min_decoding_length=n,
                                 return_end_token=True, max_batch_size=0)
        return np.array([[lookup[t] for t in r.hypotheses[0]][:n] for r in res])
    return generate


def speed(model_dir: Path, exports: dict, device: str, batches: list[int], tokens: int, runs: int) -> list[dict]:
    """p50/p90 ms per call and agreement with PyTorch fp32, per engine, batch and search (greedy, beam 4)."""
    rows = []
    found = engines(model_dir, exports, device)
    rng = np.random.default_rng(0)
    for batch in batches:
        ids = rng.integers(3, 256, (batch, tokens)).astype(np.int64)
        mask = np.ones_like(ids)
        for beams in (1, 4):
            want = found["PyTorch fp32"](ids, mask, tokens, beams)
            for name, generate in found.items():
                p50, p90, got = timed(partial(generate, ids, mask, tokens, beams), runs)
                rows.append({"engine": name, "batch": batch, "beams": beams, "p50_ms": round(p50, 1),
                             "p90_ms": round(p90, 1), "agreement_with_pytorch_fp32": agreement(np.asarray(got), want)})
    return rows


def overflow_check(root: Path, device: str) -> dict:
    """A Flan-shaped tiny model whose first-layer `wo` is scaled x2^18: plain `.half()` PyTorch overflows to inf in
    it; our fp16 export must stay finite and within the half tolerance of fp32 on `device`."""
    import torch

    from t5compress.export import ExportConfig, run
    from t5compress.model.load import load_model

    src = build("tiny", root / "model", wo_scale=2.0**18)
    naive = load_model(src, dtype=torch.float32).half()
    seen = []
    for name, module in naive.named_modules():
        if name.endswith(".wo"):
            module.register_forward_hook(lambda _m, _i, out: seen.append(bool(torch.isinf(out).any())))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        naive(input_ids=ids, decoder_input_ids=ids[:, :4])
    run(src, ExportConfig(dtype="fp16"), root / "fp16", force=True, progress=False)
    result = device_parity(src, root / "fp16", device)
    return {"wo_scale": 2.0**18, "plain_half_pytorch_wo_inf": any(seen), **result}


def shape_report(arch: str, root: Path, device: str, batches: list[int], tokens: int, runs: int) -> dict:
    started = time.perf_counter()
    model_dir = build(arch, root / arch / "model")
    exports = export_both(model_dir, root / arch)
    parity = device_parity(model_dir, Path(exports["fp16"]["dir"]), device)
    rows = speed(model_dir, exports, device, batches, tokens, runs) if batches else []
    return {"exports": exports, "device_parity": parity, "speed": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def markdown(report: dict) -> str:
    lines = [f"# GPU check on {report['device']} ({report['note']})", "",
             "| shape | fp16 / fp32 size | max abs diff vs fp32 PyTorch (enc / dec / dec-past) | worst use of "
             "tolerance | greedy agreement | finite |", "|---|---:|---|---:|---:|---|"]
    for arch, r in report["shapes"].items():
        p = r["device_parity"]
        diffs = " / ".join(f"{v:.3g}" for v in (p.get("max_abs_diff") or {}).values()) or p.get("error", "")
        lines.append(f"| {arch} | {r['exports']['fp16_size_ratio']} | {diffs} | {p.get('worst_use_of_tolerance')} "
                     f"| {p.get('greedy_agreement')} | {p['ok']} |")
    o = report["overflow"]
    lines += ["", f"Overflow model (wo x{o['wo_scale']:g}): plain .half() PyTorch wo has inf: "
              f"{o['plain_half_pytorch_wo_inf']}; our fp16 export finite and within tolerance: {o['ok']}", "",
              f"p50 ms per call, {report['tokens']} tokens in and exactly {report['tokens']} out "
              "(agreement: tokens equal to PyTorch fp32 before each row's first difference)", "",
              "| shape | engine | batch | beams | p50 ms | p90 ms | agreement |", "|---|---|---:|---:|---:|---:|---:|"]
    for arch, r in report["shapes"].items():
        lines += [f"| {arch} | {x['engine']} | {x['batch']} | {x['beams']} | {x['p50_ms']} | {x['p90_ms']} | "
                  f"{x['agreement_with_pytorch_fp32']} |" for x in r["speed"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the script's CPU fallback)")
    ap.add_argument("--note", default="", help="a line for the report, e.g. why the CPU")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="architectures, or tiny")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    report = {"device": a.device, "note": a.note or a.device, "tokens": a.tokens, "shapes": {},
              "overflow": overflow_check(work / "overflow", a.device)}
    for arch in a.shapes:
        report["shapes"][arch] = shape_report(arch, work, a.device, a.batches, a.tokens, a.runs)
        print(f"{arch}: {json.dumps(report['shapes'][arch]['device_parity'])}", flush=True)
    report["ok"] = report["overflow"]["ok"] and all(r["device_parity"]["ok"] for r in report["shapes"].values())
    from t5compress.bench.stamp import write_result

    write_result(a.out / "gpu_check", report, markdown(report))
    print(f"overflow model: {json.dumps(report['overflow'])}")
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'} on {a.device}; {a.out / 'gpu_check.md'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
