"""Where the t5compress runtime's generation time goes, per step: encoder, first decoder step, with-past steps (and
lm_head inside the decoder graphs), and the search in Python around them.

Each graph's `run` is timed in place; lm_head's share of a decoder graph comes from ONNX Runtime's own per-node
profile (the node that produces `logits`, found by walking back from that output). Everything not inside a graph
run is the search (numpy log-softmax, top-k, cache reordering, Python).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from t5compress.names import ONNX_SUFFIX

PROFILED = ("t5compress int8 static", "t5compress int8 dynamic", "t5compress int8 qat", "t5compress fp32")
CASES = ((1, 1), (8, 1), (1, 4), (8, 4))  # (batch, beams)
LINEAR_OPS = ("MatMul", "Gemm", "MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul",
              "MatMulNBits", "FusedMatMul", "QGemm")


class TimedGraph:
    """A runtime graph whose `run` calls (and, on a shared-cache graph, its session's IO-bound runs) are counted and
    timed."""

    def __init__(self, graph):
        self.graph, self.ms, self.calls = graph, 0.0, 0
        self.name, self.input_names, self.output_names = graph.name, graph.input_names, graph.output_names
        if hasattr(graph, "session"):
            self.session = TimedSession(graph.session, self)

    def __getattr__(self, name):  # what else the runtime reads of a graph (a shared-cache graph's flags and pool)
        return getattr(self.graph, name)

    def run(self, feeds):
        t0 = time.perf_counter()
        out = self.graph.run(feeds)
        self.ms += (time.perf_counter() - t0) * 1000
        self.calls += 1
        return out


class TimedSession:
    """An ONNX Runtime session whose `run_with_iobinding` calls count into a TimedGraph; all else passes through."""

    def __init__(self, session, timer: TimedGraph):
        self._session, self._timer = session, timer

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, io, *args):
        t0 = time.perf_counter()
        self._session.run_with_iobinding(io, *args)
        self._timer.ms += (time.perf_counter() - t0) * 1000
        self._timer.calls += 1


class ProfiledGraph:
    """An ONNX Runtime session with its per-node profiler on, in the runtime's Graph shape."""

    def __init__(self, path: Path, threads: int, prefix: Path):
        import onnxruntime as ort


        self.session = ort.InferenceSession(str(path), sess_options=profiling(threads, prefix),
                                            providers=["CPUExecutionProvider"])
        self.name = path.stem
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, feeds):
        values = self.session.run(None, {n: feeds[n] for n in self.input_names})
        return dict(zip(self.output_names, values, strict=True))


def profiling(threads: int, prefix: Path):
    """The runtime's session options with ONNX Runtime's per-node profiler on."""
    from t5compress.runtime import session_options

    so = session_options(threads)
    so.enable_profiling, so.profile_file_prefix = True, str(prefix)
    return so


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
    """From an ORT profile: total kernel ms, lm_head ms, nodes run per call, and the op types that take the most
    time."""
    by_op: dict[str, float] = {}
    total = head = 0.0
    runs = sum(1 for ev in trace if ev.get("cat") == "Session" and ev.get("name") == "model_run")
    nodes = sum(1 for ev in trace if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"))
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
    return {"kernel_ms": total, "lm_head_ms": head, "nodes_per_call": round(nodes / max(runs, 1)),
            "top_ops": {k: round(100 * v / total, 1) for k, v in top}}


def profile(ready: dict, shape, make_inputs, new_tokens: int, threads: int = 1, repeats: int = 3) -> dict:
    """Per-step time of each of our engines at `threads`, b1 greedy / b8 greedy / b1 beam 4 (ms per call).

    make_inputs(batch) -> (input_ids, attention_mask); every call generates exactly `new_tokens`. Times come from
    the runtime's own sessions; a second, profiled pass only gives lm_head's share, the op types and the node count
    (ONNX Runtime's profiler adds its own cost to every node).
    """
    result = {}
    for name in (n for n in PROFILED if n in ready):
        result[name] = {}
        for batch, beams in CASES:
            key = f"b{batch} {'greedy' if beams == 1 else f'beam {beams}'}"
            result[name][key] = profile_case(Path(ready[name]["path"]), shape.work / "profiles", name, batch, beams,
                                             make_inputs, new_tokens, threads, repeats)
    return result


def profile_case(path: Path, prof_dir: Path, name: str, batch: int, beams: int, make_inputs, new_tokens: int,
                 threads: int, repeats: int) -> dict:
    case = Case(path, name, batch, beams, make_inputs, new_tokens, threads)
    for _ in range(repeats):
        case.call()
    return case.result(prof_dir)


class Case:
    """One export dir at one (batch, beams): its runtime with each graph timed; `call` times one generate, `result`
    adds a profiled call's shares. Several cases can be called in turn, so that dirs compared share the machine's
    moods."""

    def __init__(self, path: Path, name: str, batch: int, beams: int, make_inputs, new_tokens: int, threads: int,
                 log_softmax=None, stored: bool = False):
        import os

        from t5compress.runtime import load_runtime
        from t5compress.runtime.sharedkv import ENV

        self.path, self.name, self.threads, self.log_softmax = path, name, threads, log_softmax
        before = os.environ.get(ENV)
        os.environ[ENV] = "0" if stored else "1"  # stored: the with-past graph as the dir holds it
        try:
            self.rt = rt = load_runtime(path, threads=threads)
        finally:
            os.environ.pop(ENV) if before is None else os.environ.__setitem__(ENV, before)
        self.ids, self.mask = make_inputs(batch)
        self.gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams)
        self.timed = {g: TimedGraph(getattr(rt.backend, a)) for g, a in (("encoder", "encoder"), ("first", "decoder"),
                                                                       ("past", "decoder_with_past"))}
        rt.backend = dataclasses.replace(rt.backend, encoder=self.timed["encoder"], decoder=self.timed["first"],
                                         decoder_with_past=self.timed["past"])
        self.generate()  # warm-up
        for t in self.timed.values():
            t.ms, t.calls = 0.0, 0
        self.wall, self.calls = 0.0, 0

    def generate(self) -> None:
        import t5compress.runtime.search as search

        fast = search.log_softmax
        search.log_softmax = self.log_softmax or fast
        try:
            self.rt.generate(self.ids, self.mask, **self.gen)
        finally:
            search.log_softmax = fast

    def call(self) -> None:
        t0 = time.perf_counter()
        self.generate()
        self.wall += (time.perf_counter() - t0) * 1000
        self.calls += 1

    def result(self, prof_dir: Path) -> dict:
        n = self.calls
        per = {g: t.ms / n for g, t in self.timed.items()}  # before the profiled call below runs the encoder again
        prof_dir.mkdir(parents=True, exist_ok=True)
        profiled = {g: ProfiledGraph(self.path / f"{stem}.onnx", self.threads, prof_dir / f"{self.name}-{g}")
                    for g, stem in (("first", "decoder_model"), ("past", "decoder_with_past_model"))}
        if getattr(self.timed["past"], "shared_cache", False):  # profile what the runtime runs: the rewrite
            from t5compress.runtime.sharedkv import open_shared

            prefix = prof_dir / f"{self.name}-past"
            profiled["past"] = open_shared(self.path, profiling(self.threads, prefix))
        self.rt.backend = dataclasses.replace(self.rt.backend, decoder=profiled["first"],
                                              decoder_with_past=profiled["past"])
        self.generate()
        shares = {g: node_shares(json.loads(Path(x.session.end_profiling()).read_text()),
                                 lm_head_node(self.path / f"{x.name}{ONNX_SUFFIX}")) for g, x in profiled.items()}
        steps = max(1, self.timed["past"].calls // n)
        head = sum(per[g] * shares[g]["lm_head_ms"] / shares[g]["kernel_ms"] for g in ("first", "past")
                   if shares[g]["kernel_ms"])
        return {
            "total_ms": round(self.wall / n, 1), "encoder_ms": round(per["encoder"], 1),
            "first_step_ms": round(per["first"], 1), "with_past_ms": round(per["past"], 1), "with_past_steps": steps,
            "with_past_ms_per_step": round(per["past"] / steps, 2),
            "lm_head_ms (inside the decoder steps)": round(head, 1),
            "search_and_python_ms": round(self.wall / n - sum(per.values()), 1),
            "nodes_per_with_past_step": shares["past"]["nodes_per_call"],
            "top_ops_with_past_%": shares["past"]["top_ops"],
        }


def numpy_log_softmax(x):
    """The search's log-softmax before it moved into ONNX Runtime (for a 'before' row)."""
    import numpy as np

    out = x - x.max(axis=-1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=-1, keepdims=True))
    return out


def main() -> None:
    """Profile export dirs side by side, in one process: `NAME=DIR ...`; --numpy-log-softmax NAME runs NAME with the
    old numpy log-softmax (a 'before' row: give it a dir exported by the code before the change, too)."""
    import argparse

    import numpy as np

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="NAME=DIR")
    ap.add_argument("--numpy-log-softmax", nargs="*", default=[], help="names run with numpy's log-softmax")
    ap.add_argument("--stored", nargs="*", default=[],
                    help="names whose with-past graph runs as the dir stores it (no shared cache)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    rows = np.random.default_rng(0).integers(3, 250, size=(8, 32))
    rows[:, -1] = 1

    def make_inputs(batch):
        return rows[:batch], np.ones_like(rows[:batch])

    dirs = [spec.partition("=")[::2] for spec in args.dirs]
    result: dict = {name: {} for name, _ in dirs}
    for batch, beams in (*CASES, (8, 4)):
        key = f"b{batch} {'greedy' if beams == 1 else f'beam {beams}'}"
        cases = [Case(Path(d), name, batch, beams, make_inputs, 32, args.threads,
                      numpy_log_softmax if name in args.numpy_log_softmax else None, name in args.stored)
                 for name, d in dirs]
        for _ in range(args.repeats):  # one call of each dir in turn: a busy moment costs every dir alike
            for case in cases:
                case.call()
        for case in cases:
            result[case.name][key] = case.result(Path(tempfile.mkdtemp(prefix="t5c-profile-")))
    from t5compress.bench.stamp import write_result

    md = markdown(result, args.threads)
    write_result(args.out.with_suffix(""), {"threads": args.threads, "profiles": result}, md)
    print(md)


def markdown(result: dict, threads: int) -> str:
    cols = ["total_ms", "encoder_ms", "first_step_ms", "with_past_ms_per_step",
            "lm_head_ms (inside the decoder steps)", "search_and_python_ms", "nodes_per_with_past_step"]
    lines = [f"# Where one generate call goes ({threads} thread{'s' if threads > 1 else ''}, 32 in, exactly 32 out)",
             "", "| dir | case | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for name, cases in result.items():
        for case, x in cases.items():
            lines.append(f"| {name} | {case} | " + " | ".join(str(x[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
