"""Thread settings of the runtime's sessions (`runtime.threads`): workers spin while a run lasts only, on every graph
a runtime opens with more than one thread; none spin at one thread; more threads open no more sessions; the default
thread count is the machine's cores, SMT siblings counted once."""

from __future__ import annotations

import pytest

from t5compress.runtime import load_runtime, session_options, threads

SPIN, STOP, INTER = "session.intra_op.allow_spinning", "session.force_spinning_stop", "session.inter_op.allow_spinning"


def entry(options, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except Exception:  # onnxruntime raises when the key was never set
        return None


@pytest.mark.parametrize("count", [0, 2, 4])
def test_a_pool_spins_while_a_run_lasts(count):
    so = session_options(count)
    assert so.intra_op_num_threads == count and so.inter_op_num_threads == 1
    assert (entry(so, SPIN), entry(so, STOP), entry(so, INTER)) == ("1", "1", "0")


def test_one_thread_never_spins():
    so = session_options(1)
    assert so.intra_op_num_threads == 1
    assert (entry(so, SPIN), entry(so, STOP), entry(so, INTER)) == ("0", None, "0")


def sessions_of(rt) -> dict:
    b = rt.backend
    graphs = {"encoder": b.encoder, "decoder": b.decoder, "with-past": b.decoder_with_past}
    # the first step on the with-past graph (runtime.firststep) has a session of its own for the cross-attention cache
    return {name: (g.session if hasattr(g, "session") else g.cross).get_session_options()
            for name, g in graphs.items()}


@pytest.mark.parametrize("count", [1, 2])
def test_every_graph_of_a_runtime_gets_the_settings(gated_export, count):
    rt = load_runtime(gated_export, threads=count)
    opened = sessions_of(rt)
    assert set(opened) == {"encoder", "decoder", "with-past"}
    for name, so in opened.items():
        assert so.intra_op_num_threads == count, name
        assert (entry(so, SPIN), entry(so, STOP)) == (("0", None) if count == 1 else ("1", "1")), name


def test_more_threads_open_no_more_sessions(gated_export, monkeypatch):
    """Two threads open the sessions one thread opens, no more: the runtime used to open a second, one-thread
    with-past session at load and time a step on both, which doubled the load time and added 80 MB (t5-small) to
    235 MB (t5-base) to the peak memory at load, for a session the spinning pool beat in every measurement since
    (docs/benchmarks.md, "Threads")."""
    import onnxruntime as ort

    opened = []
    real = ort.InferenceSession.__init__

    def counting(self, *args, **kwargs):
        opened.append(kwargs.get("sess_options") or (args[1] if len(args) > 1 else None))
        real(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting)
    counts = {}
    for count in (1, 2):
        opened.clear()
        load_runtime(gated_export, threads=count)
        counts[count] = len(opened)
        assert all(so is None or so.intra_op_num_threads == count for so in opened)
    assert counts[2] == counts[1] > 0, counts


def test_default_threads_count_cores_not_siblings(tmp_path, monkeypatch):
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3"), (4, "4")):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
    assert threads.physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert threads.physical_cores({0, 2}, tmp_path) == 1
    assert threads.physical_cores({7, 8}, tmp_path) == 2  # no topology files: each CPU counts
    monkeypatch.setattr(threads, "physical_cores", lambda: 64)
    assert threads.default_threads() == threads.MAX_DEFAULT_THREADS
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    assert threads.default_threads() == 2


def test_generate_defaults_to_the_machines_cores(gated_export, monkeypatch):
    from typer.testing import CliRunner

    import t5compress.runtime as runtime
    from t5compress.cli import app

    seen = []

    def fake_load(path, threads, **_):
        seen.append(threads)
        raise SystemExit(0)  # the thread count is all this test wants

    monkeypatch.setattr(threads, "default_threads", lambda: 3)
    monkeypatch.setattr(runtime, "load_runtime", fake_load)
    runner = CliRunner()
    for args, want in (([], 3), (["--threads", "1"], 1), (["--threads", "0"], 0)):
        runner.invoke(app, ["generate", str(gated_export), "hello", *args])
        assert seen.pop() == want
    import typer

    option = next(p for p in typer.main.get_command(app).commands["generate"].params if p.name == "threads")
    assert "Default: one per physical core of this machine, at most 8" in option.help  # what --help shows
