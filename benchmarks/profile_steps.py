"""Where the t5compress runtime's generation time goes, per step: encoder, first decoder step, with-past steps (and
lm_head inside the decoder graphs), and the search in Python around them.

Each graph's `run` is timed in place; lm_head's share of a decoder graph comes from ONNX Runtime's own per-node
profile (the node that produces `logits`, found by walking back from that output). Everything not inside a graph
run is the search (numpy log-softmax, top-k, cache reordering, Python).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

PROFILED = ("t5compress int8 static", "t5compress int8 dynamic", "t5compress int8 qat", "t5compress fp32")
CASES = ((1, 1), (8, 1), (1, 4))  # (batch, beams)
LINEAR_OPS = ("MatMul", "Gemm", "MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul",
              "FusedMatMul", "QGemm")


class TimedGraph:
    """A runtime graph whose `run` calls are counted and timed."""

    def __init__(self, graph):
        self.graph, self.ms, self.calls = graph, 0.0, 0
        self.name, self.input_names, self.output_names = graph.name, graph.input_names, graph.output_names

    def run(self, feeds):
        t0 = time.perf_counter()
        out = self.graph.run(feeds)
        self.ms += (time.perf_counter() - t0) * 1000
        self.calls += 1
        return out


class ProfiledGraph:
    """An ONNX Runtime session with its per-node profiler on, in the runtime's Graph shape."""

    def __init__(self, path: Path, threads: int, prefix: Path):
        import onnxruntime as ort

        from t5compress.runtime import session_options

        so = session_options(threads)
        so.enable_profiling, so.profile_file_prefix = True, str(prefix)
        self.session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self.name = path.stem
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, feeds):
        values = self.session.run(None, {n: feeds[n] for n in self.input_names})
        return dict(zip(self.output_names, values, strict=True))


def lm_head_node(path: Path) -> str | None:
    """The name of the linear node that computes `logits` (lm_head), walking back through Q/DQ, casts and scales."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    name, seen = "logits", set()
    while name in producer and name not in seen:
        seen.add(name)
        node = producer[name]
        if node.op_type in LINEAR_OPS:
            return node.name
        name = node.input[0]
    return None


def node_shares(trace: list[dict], lm_head: str | None) -> dict:
    """From an ORT profile: total kernel ms, lm_head ms, and the op types that take the most time."""
    by_op: dict[str, float] = {}
    total = head = 0.0
    for ev in trace:
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        ms = ev["dur"] / 1000
        total += ms
        op = ev.get("args", {}).get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + ms
        if lm_head and ev["name"].startswith(lm_head):
            head += ms
    top = sorted(by_op.items(), key=lambda x: -x[1])[:6]
    return {"kernel_ms": total, "lm_head_ms": head, "top_ops": {k: round(100 * v / total, 1) for k, v in top}}


def profile(ready: dict, shape, make_inputs, new_tokens: int, threads: int = 1, repeats: int = 3) -> dict:
    """Per-step time of each of our engines at `threads`, b1 greedy / b8 greedy / b1 beam 4 (ms per call).

    make_inputs(batch) -> (input_ids, attention_mask); every call generates exactly `new_tokens`.
    """
    from t5compress.runtime import load_runtime

    result = {}
    for name in (n for n in PROFILED if n in ready):
        path = ready[name]["path"]
        result[name] = {}
        for batch, beams in CASES:
            rt = load_runtime(path, threads=threads)
            prof_dir = shape.work / "profiles"
            prof_dir.mkdir(exist_ok=True)
            first = ProfiledGraph(path / "decoder_model.onnx", threads, prof_dir / f"{name}-first")
            past = ProfiledGraph(path / "decoder_with_past_model.onnx", threads, prof_dir / f"{name}-past")
            timed = {g: TimedGraph(x) for g, x in (("encoder", rt.backend.encoder), ("first", first),
                                                     ("past", past))}
            rt.backend = dataclasses.replace(rt.backend, encoder=timed["encoder"], decoder=timed["first"],
                                             decoder_with_past=timed["past"])
            ids, mask = make_inputs(batch)
            rt.generate(ids, mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams)  # warm
            for t in timed.values():
                t.ms, t.calls = 0.0, 0
            t0 = time.perf_counter()
            for _ in range(repeats):
                rt.generate(ids, mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams)
            wall = (time.perf_counter() - t0) * 1000 / repeats
            shares = {}
            for g, graph in (("first", first), ("past", past)):
                trace = json.loads(Path(graph.session.end_profiling()).read_text())
                shares[g] = node_shares(trace, lm_head_node(path / f"{graph.name}.onnx"))
            per = {g: t.ms / repeats for g, t in timed.items()}
            head = sum(per[g] * shares[g]["lm_head_ms"] / shares[g]["kernel_ms"] for g in ("first", "past")
                       if shares[g]["kernel_ms"])
            result[name][f"b{batch} {'greedy' if beams == 1 else f'beam {beams}'}"] = {
                "total_ms": round(wall, 1), "encoder_ms": round(per["encoder"], 1),
                "first_step_ms": round(per["first"], 1),
                "with_past_ms": round(per["past"], 1), "with_past_steps": timed["past"].calls // repeats,
                "with_past_ms_per_step": round(per["past"] / max(1, timed["past"].calls // repeats), 2),
                "lm_head_ms (inside the decoder steps)": round(head, 1),
                "search_and_python_ms": round(wall - sum(per.values()), 1),
                "top_ops_with_past_%": shares["past"]["top_ops"],
            }
    return result
