"""Triton model repositories of a tiny real T5 export: configs through Triton's own schema, and a real server.

The server tests start the tritonserver of nvidia-pytriton (`make triton-env`, which `make test` builds) on
127.0.0.1 with free ports, serve the `--portable` repository (that server has no ONNX Runtime backend), and stop it
by PID. Every served answer is compared with the package's local runtime on the same export: identical text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError, ModelError, OutputError
from t5compress.names import GRAPHS
from t5compress.triton import TritonConfig, run
from t5compress.triton import config as pbtxt
from t5compress.triton.server import ENV_VAR, Ports, ServerError, find_server, open_log, start

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
TEXTS = ["translate: hello world", "summarize: a b c d e f", "xyz", "the cat sat on the mat", "42 + 17 = ?",
         "Grüße aus Köln", "one two three four five six seven", "q"]


@pytest.fixture(scope="module")
def export_dir(runtime_export) -> Path:
    """A tiny T5 whose outputs end with EOS at different steps (test_runtime's model), so that rows batched with
    longer ones, finished beams and per-request cropping are exercised; exported by the export stage."""
    return runtime_export[1]


@pytest.fixture(scope="module")
def local(export_dir):
    from t5compress.runtime import load_runtime

    return load_runtime(export_dir)


def _models(repo: Path) -> dict:
    return {d.name: pbtxt.parse_config(d / "config.pbtxt") for d in sorted(repo.iterdir()) if d.is_dir()}


def test_onnxruntime_repository_configs_parse_and_name_the_right_files_and_tensors(export_dir, tmp_path):
    repo = tmp_path / "repo"
    report = run(export_dir, TritonConfig(name="t5", leaves=True, instances=2, threads=2), repo)
    models = _models(repo)
    assert set(models) == {"t5", "t5_encoder", "t5_decoder", "t5_decoder_with_past"} == set(report["models"])
    graphs = json.loads((export_dir / "graphs.json").read_text())
    for graph, leaf in zip(GRAPHS, ["t5_encoder", "t5_decoder", "t5_decoder_with_past"], strict=True):
        c = models[leaf]
        assert c.platform == "onnxruntime_onnx" and not c.backend
        assert (repo / leaf / "1" / c.default_model_filename).is_file()
        assert c.default_model_filename == f"{graph}.onnx"
        assert [i.name for i in c.input] == graphs[graph]["inputs"]
        assert [o.name for o in c.output] == graphs[graph]["outputs"]
        assert c.max_batch_size == 8 * 4  # requests x beams rows
        assert c.HasField("dynamic_batching")
        assert [(g.kind, g.count) for g in c.instance_group] == [(2, 2)]  # KIND_CPU x 2
        assert c.parameters["intra_op_thread_count"].string_value == "2"
        types = {t.name: (t.data_type, list(t.dims)) for t in [*c.input, *c.output]}
        proto = onnx.load(str(export_dir / f"{graph}.onnx"), load_external_data=False).graph
        for v in [*proto.input, *proto.output]:  # every tensor: the ONNX shape less its batch axis
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
            assert types[v.name][1] == shape[1:], (leaf, v.name)
        assert types["input_ids"][0] == 9 and types["encoder_attention_mask" if graph != GRAPHS[0]
                                                    else "attention_mask"][0] == 9  # TYPE_INT64
        if graph == GRAPHS[2]:
            assert types["past_key_values.1.encoder.value"] == (11, [4, -1, 8])  # TYPE_FP32 (heads, enc_len, d_kv)
            assert types["logits"] == (11, [-1, 384])  # (len, vocab)
    bls = models["t5"]
    # Declared past any request so that Triton hands an oversized one to the model; the real limit is a parameter.
    assert bls.backend == "python" and bls.max_batch_size == 2**31 - 1
    assert report["models"]["t5"]["max_batch_size"] == 8  # what a request may hold
    assert bls.parameters["max_batch_texts"].string_value == "8"
    assert list(bls.dynamic_batching.preferred_batch_size) == [8]
    assert [i.name for i in bls.input][:2] == ["TEXT", "max_new_tokens"]
    assert [i.optional for i in bls.input].count(True) == len(bls.input) - 1
    assert [o.name for o in bls.output] == ["OUTPUT_TEXT", "OUTPUT_IDS", "INPUT_TOKENS", "TRUNCATED"]
    assert json.loads(bls.parameters["leaf_models"].string_value)["decoder_with_past_model"] == "t5_decoder_with_past"
    version = repo / "t5" / "1"
    assert (version / "model.py").read_text() == (ROOT / "triton_models" / "t5_bls.py").read_text()
    for f in ("tokenizer.json", "config.json", "generation_config.json", "graphs.json",
              "t5compress/runtime/search.py", "t5compress/errors.py"):
        assert (version / f).is_file(), f
    assert (repo / "t5" / "config.pbtxt").stat().st_mode & 0o044 == 0o044  # readable by the server's user
    assert json.loads((repo / "report.json").read_text())["flavour"] == "onnxruntime"


def test_gpu_and_portable_flavours(export_dir, tmp_path):
    run(export_dir, TritonConfig(name="m", kind="gpu", instances=3), tmp_path / "gpu")
    gpu = _models(tmp_path / "gpu")
    assert [(g.kind, g.count) for g in gpu["m_decoder"].instance_group] == [(1, 3)]  # KIND_GPU x 3
    assert [g.kind for g in gpu["m"].instance_group] == [2]  # the BLS model stays on CPU
    run(export_dir, TritonConfig(name="m", portable=True), tmp_path / "portable")
    portable = _models(tmp_path / "portable")
    leaf = portable["m_encoder"]
    assert leaf.backend == "python" and not leaf.platform
    assert leaf.parameters["graph_file"].string_value == "encoder_model.onnx"
    assert (tmp_path / "portable" / "m_encoder" / "1" / "model.py").read_text() == \
        (ROOT / "triton_models" / "onnx_graph.py").read_text()
    assert [i.name for i in leaf.input] == [i.name for i in gpu["m_encoder"].input]


def test_the_text_model_generates_a_long_queues_batch_max_batch_texts_at_a_time():
    """The dynamic batcher may hand the text model more texts than the limit at once (its declared max_batch_size is
    larger): they are generated in runs of whole requests, each within the limit, one settings group at a time."""
    from t5compress.runtime.scheduler import Job, batches
    from t5compress.runtime.settings import GenerationSettings

    greedy, beam = GenerationSettings(), GenerationSettings(num_beams=2)
    jobs = [Job([str(k)] * n, greedy, sink=None) for k, n in enumerate([3, 3, 2, 8, 1, 7])]
    assert [[j.texts[0] for j in run] for run in batches(jobs, 8)] == [["0", "1", "2"], ["3"], ["4", "5"]]
    assert batches([], 8) == []
    mixed = [Job(["a"], greedy, None), Job(["b"], beam, None), Job(["c"], greedy, None)]
    assert [[j.texts[0] for j in run] for run in batches(mixed, 8)] == [["a", "c"], ["b"]]


def test_the_wire_contract_is_the_generation_settings_and_round_trips(export_dir, tmp_path):
    """Every GenerationSettings field is an optional input of the text model, typed from the field; what the client
    sends is what the model reads back; the config's inputs and outputs are the contract's."""
    import dataclasses

    from t5compress.runtime import contract
    from t5compress.runtime.settings import GenerationSettings
    from t5compress.triton.client import inputs

    fields = {f.name for f in dataclasses.fields(GenerationSettings)}
    assert {t.name for t in contract.SETTINGS} == fields and len(contract.SETTINGS) == 8
    types = {t.name: t.data_type for t in contract.SETTINGS}
    assert types["num_beams"] == "TYPE_INT32" and types["length_penalty"] == "TYPE_FP32"
    assert types["early_stopping"] == "TYPE_STRING"
    sent = dict(num_beams=3, length_penalty=0.5, early_stopping="never", max_new_tokens=None)
    arrays = {t.name: a for t, a in contract.request(["hi", "there"], stream=True, **sent)}
    assert [t.name() for t in inputs("http", ["hi", "there"], True, **sent)] == list(arrays)
    texts, got = contract.read_request(arrays.get, 8, "t5")
    assert texts == ["hi", "there"] and got == dict(num_beams=3, length_penalty=0.5, early_stopping="never")
    assert contract.wants_stream(arrays.get)
    assert contract.read_request({**arrays, "early_stopping": np.array([[b"True"], [b"True"]])}.get, 8, "t5")[1][
        "early_stopping"] is True
    with pytest.raises(contract.TooManyTexts, match="at most 1 texts"):
        contract.read_request(arrays.get, 1, "t5")
    with pytest.raises(ConfigError, match="unknown generation setting.*temperature"):
        contract.request(["hi"], temperature=0.7)
    run(export_dir, TritonConfig(name="t5", inflight=True), tmp_path / "repo")
    config = pbtxt.parse_config(tmp_path / "repo" / "t5" / "config.pbtxt")
    assert [i.name for i in config.input] == [t.name for t in contract.inputs(decoupled=True)]
    assert [o.name for o in config.output] == [t.name for t in contract.OUTPUTS]


def test_schema_and_checks_refuse_bad_configs():
    good = {"name": "x", "backend": "python", "max_batch_size": 1, "input": [pbtxt.tensor("A", "TYPE_STRING", [1])],
            "output": [pbtxt.tensor("B", "TYPE_FP32", [-1])]}
    assert pbtxt.build(good).name == "x"
    with pytest.raises(ConfigError, match="schema.*bogus"):
        pbtxt.build({**good, "bogus": 1})
    with pytest.raises(ConfigError, match="schema"):
        pbtxt.build({**good, "instance_group": [{"kind": "KIND_TPU"}]})
    with pytest.raises(ConfigError, match="dims"):
        pbtxt.build({**good, "input": [pbtxt.tensor("A", "TYPE_STRING", [0])]})
    with pytest.raises(ConfigError, match="repeated"):
        pbtxt.build({**good, "output": [pbtxt.tensor("A", "TYPE_FP32", [1])]})
    with pytest.raises(ConfigError, match="max_batch_size"):
        pbtxt.build({**good, "max_batch_size": 0, "dynamic_batching": {}})
    with pytest.raises(ConfigError, match="preferred"):
        pbtxt.build({**good, "dynamic_batching": {"preferred_batch_size": [2]}})
    with pytest.raises(ConfigError, match="name"):
        TritonConfig(name="a/b")
    with pytest.raises(ConfigError, match="instance kind"):
        TritonConfig(kind="tpu")


def test_stage_refuses_non_exports_and_existing_output(export_dir, tmp_path):
    with pytest.raises(ModelError, match="not an export directory"):
        run(export_dir.parent, TritonConfig(), tmp_path / "repo")
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputError, match="--force"):
        run(export_dir, TritonConfig(leaves=True), tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing half-written beside it
    run(export_dir, TritonConfig(leaves=True), tmp_path / "taken", force=True)
    assert (tmp_path / "taken" / "t5_decoder" / "config.pbtxt").is_file()


def test_the_default_cpu_repository_is_one_text_model_that_runs_the_graphs_itself(export_dir, tmp_path):
    report = run(export_dir, TritonConfig(name="t5", threads=2, bls_instances=2), tmp_path / "repo")
    assert report["flavour"] == "in-process" and list(report["models"]) == ["t5"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir() if p.is_dir()) == ["t5"]
    version = tmp_path / "repo" / "t5" / "1"
    for g in GRAPHS:  # the export's graphs, byte for byte, beside the model file
        assert (version / f"{g}.onnx").read_bytes() == (export_dir / f"{g}.onnx").read_bytes()
    cfg = pbtxt.parse_config(tmp_path / "repo" / "t5" / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["in_process"] == "1" and params["intra_op_thread_count"] == "2" and "leaf_models" not in params
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(2, cfg.instance_group[0].KIND_CPU)]
    gpu = run(export_dir, TritonConfig(name="g", kind="gpu"), tmp_path / "gpu")
    assert gpu["flavour"] == "onnxruntime" and len(gpu["models"]) == 4  # on a GPU: leaves, as before


def test_cli_triton_happy_path_and_bad_input(export_dir, tmp_path):
    result = runner.invoke(app, ["triton", str(export_dir), str(tmp_path / "repo"), "--portable", "--name", "tiny"])
    assert result.exit_code == 0, result.output
    assert "tiny_decoder_with_past" in result.output and "schema" in result.output
    assert (tmp_path / "repo" / "tiny" / "config.pbtxt").is_file()
    bad = runner.invoke(app, ["triton", str(export_dir), str(tmp_path / "r2"), "--kind", "tpu"])
    assert bad.exit_code != 0 and "unknown instance kind 'tpu'" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "r2").exists()


def test_serve_without_a_server_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no tritonserver on PATH
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "no-env"))
    result = runner.invoke(app, ["serve", str(tmp_path)])
    assert result.exit_code != 0
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "make triton-env" in lines[0], result.output
    bad = runner.invoke(app, ["serve", str(tmp_path), "--tritonserver", str(tmp_path / "nope")])
    assert bad.exit_code != 0 and "is not an executable file" in bad.output and "Traceback" not in bad.output


def test_bench_triton_without_a_server_is_one_line(tmp_path):
    port = Ports.free().http
    result = runner.invoke(app, ["bench-triton", f"127.0.0.1:{port}", "--requests", "1"])
    assert result.exit_code != 0
    assert f"no Triton server answers http at 127.0.0.1:{port}" in result.output and "Traceback" not in result.output


def test_server_log_never_follows_a_planted_link_or_writes_another_file(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "server.log"
    link.symlink_to(target)
    with pytest.raises(ServerError, match="symbolic link"):
        open_log(link)
    os.link(target, tmp_path / "hard.log")  # a second name for the same file
    with pytest.raises(ServerError, match="single link"):
        open_log(tmp_path / "hard.log")
    os.mkfifo(tmp_path / "fifo.log")  # no reader: must fail, not block
    with pytest.raises(ServerError, match="server log"):
        open_log(tmp_path / "fifo.log")
    assert target.read_text() == "keep me\n"
    fresh = tmp_path / "fresh.log"
    fresh.write_text("old run\n")  # our own regular file is reused, emptied
    os.close(open_log(fresh))
    assert fresh.read_text() == ""


def test_serve_writes_its_default_log_under_a_fresh_name_not_a_planted_one(tmp_path, monkeypatch):
    """`serve` used to write /tmp/t5compress-tritonserver-<pid>.log: a link planted there redirected the log."""
    import signal
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / f"t5compress-tritonserver-{os.getpid()}.log").symlink_to(target)  # the old name, this process's pid
    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\necho 'E1204 00:00:00.0 1 fake.cc:1] \"fake server gives up\"'\nexit 3\n")
    fake.chmod(0o755)
    (tmp_path / "repo").mkdir()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # serve installs its own
    try:
        result = runner.invoke(app, ["serve", str(tmp_path / "repo"), "--tritonserver", str(fake), "--timeout", "20"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert result.exit_code != 0 and "fake server gives up" in result.output, result.output
    assert target.read_text() == "keep me\n"
    logs = [p for p in tmp_path.glob("t5compress-tritonserver-*.log") if not p.is_symlink()]
    assert len(logs) == 1 and str(logs[0]) in result.output.replace("\n", "")
    assert "fake server gives up" in logs[0].read_text()


# ---- a real server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["in-process", "portable"])
def server(export_dir, tmp_path_factory, request):
    repo = tmp_path_factory.mktemp("served") / "repo"
    # Input limit 40 tokens: above every text of TEXTS (bytes + EOS), so only the over-long request is cut.
    run(export_dir, TritonConfig(name="t5", portable=request.param == "portable", max_batch_size=8, max_beams=4,
                                 max_input_tokens=40), repo)
    running = start(find_server(), repo, Ports.free(), log_path=repo.parent / "server.log")
    yield running
    pid = running.pid
    assert running.stop() == 0  # SIGTERM: a clean shutdown
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _client(server, protocol: str):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    if protocol == "http":
        return http.InferenceServerClient(server.http_url)
    return grpc.InferenceServerClient(server.grpc_url)


@pytest.mark.slow
def test_served_text_over_http_and_grpc_is_the_local_runtime(server, local):
    from t5compress.triton.client import infer, inputs

    texts = TEXTS[:4]
    cases = [dict(), dict(max_new_tokens=12), dict(num_beams=3, num_return_sequences=2, max_new_tokens=10)]
    for protocol in ("http", "grpc"):
        client = _client(server, protocol)
        try:
            for settings in cases:
                got = infer(client, protocol, "t5", texts, **settings)
                n = settings.get("num_return_sequences", 1)
                want = local.generate_text(texts, **settings)
                assert got == [want[k * n:(k + 1) * n] for k in range(len(texts))], (protocol, settings)
            for beams in (1, 2):
                result = client.infer("t5", inputs(protocol, texts, num_beams=beams))
                want_ids = local.generate(*local.encode(texts), num_beams=beams)  # (batch, len)
                got_ids = result.as_numpy("OUTPUT_IDS")  # (batch, 1, len)
                np.testing.assert_array_equal(got_ids[:, 0, :], want_ids)
        finally:
            client.close()


@pytest.mark.slow
def test_eight_concurrent_clients_get_right_answers_and_the_server_batches(server, local):
    """Single-text requests batched by the server come back as if each were generated alone (text and token ids)."""
    from t5compress.triton.client import batch_statistics, inputs

    want = {t: (local.generate_text([t], max_new_tokens=8), local.generate(*local.encode([t]), max_new_tokens=8))
            for t in TEXTS}
    before = batch_statistics(server.http_url, "t5")
    per_client, wrong, failures = 32, [], []

    def client_loop(k: int) -> None:
        protocol = "http" if k % 2 else "grpc"
        client = _client(server, protocol)
        try:
            for j in range(per_client):
                text = TEXTS[(k + j) % len(TEXTS)]
                result = client.infer("t5", inputs(protocol, [text], max_new_tokens=8))
                got_text = [t.decode() for t in result.as_numpy("OUTPUT_TEXT")[0]]
                got_ids = result.as_numpy("OUTPUT_IDS")[0]  # (1, len): cropped to this request's own length
                if got_text != want[text][0] or not np.array_equal(got_ids, want[text][1]):
                    wrong.append((text, got_text, got_ids.tolist()))
        except Exception as e:  # collected: an assert in a thread would not fail the test
            failures.append(repr(e))
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and not wrong, (failures[:3], wrong[:3])
    deadline = time.monotonic() + 10  # Triton counts a request after its response is sent: let the last ones land
    while True:
        after = batch_statistics(server.http_url, "t5")
        requests = after["inference_count"] - before["inference_count"]
        if requests >= 8 * per_client or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    batches = after["execution_count"] - before["execution_count"]
    assert requests == 8 * per_client
    assert batches < requests * 0.75, (requests, batches)  # dynamic batching put several requests in one execution


@pytest.mark.slow
def test_bad_requests_get_errors_and_the_server_keeps_serving(server, local):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    from t5compress.triton.client import infer, inputs

    client = http.InferenceServerClient(server.http_url)
    want = local.generate_text(["q"])

    def text_tensor(shape, dtype, value):
        t = http.InferInput("TEXT", list(shape), dtype)
        t.set_data_from_numpy(np.full(shape, value, dtype=np.object_ if dtype == "BYTES" else np.int32))
        return t

    def beams(n):
        t = http.InferInput("num_beams", [1, 1], "INT32")
        t.set_data_from_numpy(np.full((1, 1), n, dtype=np.int32))
        return t

    unknown = http.InferInput("temperature", [1, 1], "FP32")
    unknown.set_data_from_numpy(np.ones((1, 1), np.float32))
    bad = {
        "missing TEXT": ([beams(2)], "TEXT"),
        "wrong dtype": ([text_tensor((1, 1), "INT32", 5)], "data-type"),
        "wrong shape": ([text_tensor((1, 2), "BYTES", b"hi")], "shape"),
        "empty text": ([text_tensor((1, 1), "BYTES", b"  ")], "TEXT is empty"),
        "unknown parameter": ([text_tensor((1, 1), "BYTES", b"hi"), unknown], "temperature"),
        "too many beams": ([text_tensor((1, 1), "BYTES", b"hi"), beams(9)], "num_beams must be at most 4"),
        "invalid setting": (inputs("http", ["hi"], num_beams=2, num_return_sequences=3), "num_return_sequences"),
    }
    for case, (tensors, needle) in bad.items():
        with pytest.raises(InferenceServerException) as err:
            client.infer("t5", tensors)
        assert needle in str(err.value), (case, str(err.value))
        assert infer(client, "http", "t5", ["q"]) == [want], case  # still serving, still right
    assert server.process.poll() is None and server.ready()
    # Over-long text: cut to the repository's 40-token limit (first 39 tokens + </s>), and the response says so.
    long = "the cat sat on the mat and looked at the long road ahead " * 3
    result = client.infer("t5", inputs("http", [long, "q"]))
    assert result.as_numpy("TRUNCATED").reshape(-1).tolist() == [True, False]
    assert result.as_numpy("INPUT_TOKENS").reshape(-1).tolist() == [len(long.encode()) + 1, 2]
    want_long = local.decode(local.generate(*local.encode([long], max_input_tokens=40)))
    assert [t.decode() for t in result.as_numpy("OUTPUT_TEXT")[0]] == want_long
    client.close()


@pytest.mark.slow
def test_a_request_over_the_max_batch_size_fails_alone_says_why_and_logs_one_line(server, local):
    """Triton's own batch-size check refused it before the model saw it, and logged nothing. Requests queued with it
    (together more texts than the limit, which may reach the model in one batch: it generates them 8 at a time) and
    the one running get right answers."""
    import tritonclient.http as http

    from t5compress.triton.client import ClientError, infer

    long = dict(max_new_tokens=400, min_new_tokens=400)
    cases = [(TEXTS[:1], long)] + [(TEXTS[k:k + 3], dict(max_new_tokens=8)) for k in range(0, 8, 2)]  # 1 + 4 x 3
    results, failures = {}, []

    def client_loop(k: int) -> None:
        client = http.InferenceServerClient(server.http_url)
        try:
            results[k] = infer(client, "http", "t5", cases[k][0], **cases[k][1])
        except Exception as e:  # collected: an assert in a thread would not fail the test
            failures.append(repr(e))
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(len(cases))]
    threads[0].start()
    time.sleep(0.05)  # the long one first: the others queue behind it and reach the model together
    for t in threads[1:]:
        t.start()
    client = http.InferenceServerClient(server.http_url)
    with pytest.raises(ClientError) as err:
        infer(client, "http", "t5", TEXTS + ["one more"])  # 9 texts, the limit is 8
    message = str(err.value)
    assert "at most 8 texts" in message and "holds 9" in message and "--max-batch-size" in message, message
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]
    for k, (texts, settings) in enumerate(cases):
        assert results[k] == [[t] for t in local.generate_text(texts, **settings)], (k, settings)
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:  # the stub's log lines reach the server log a little later
        time.sleep(0.1)
        lines = [ln for ln in server.log_path.read_text(errors="replace").splitlines() if "holds 9" in ln]
    assert len(lines) == 1 and "at most 8 texts" in lines[0], lines
    assert infer(client, "http", "t5", ["q"]) == [local.generate_text(["q"])]
    client.close()


@pytest.mark.slow
def test_bench_triton_cli_measures_both_protocols(server, tmp_path):
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench-triton", server.http_url, "--grpc-url", server.grpc_url, "--protocol", "http",
                                 "--protocol", "grpc", "--concurrency", "1", "--concurrency", "4", "--requests", "12",
                                 "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["protocol"], r["concurrency"], r["ok"], r["errors"]) for r in rows] == [
        ("http", 1, 12, 0), ("http", 4, 12, 0), ("grpc", 1, 12, 0), ("grpc", 4, 12, 0)]
    assert all(0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] for r in rows)
    assert "req/s" in result.output


@pytest.mark.slow
def test_bench_triton_soak_is_bounded_in_time_and_reads_the_servers_memory(server, tmp_path):
    """A soak asked for far more requests than fit in --max-seconds stops sending at the bound; the answers are all
    non-empty, and the local server's RSS (tritonserver plus its python stubs) is read before and after."""
    out = tmp_path / "soak.json"
    result = runner.invoke(app, ["bench-triton", server.http_url, "--concurrency", "4", "--requests", "100000",
                                 "--max-seconds", "4", "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    (row,) = saved["rows"]
    assert 4 <= row["ok"] < 100000 and row["errors"] == 0 and row["empty"] == 0 and row["sent"] == row["ok"]
    assert row["seconds"] < 4 + 60  # requests in flight at the bound finish; nothing new is sent after it
    rss = saved["server_rss_mb"]
    assert 50 < rss["before"] < 8000 and 50 < rss["after"] < 8000, rss
    assert "server memory" in result.output and "empty" in result.output


@pytest.mark.slow
def test_serving_the_onnxruntime_repository_without_that_backend_is_one_line(export_dir, tmp_path):
    run(export_dir, TritonConfig(leaves=True), tmp_path / "repo")
    ports = Ports.free()
    result = runner.invoke(app, ["serve", str(tmp_path / "repo"), "--http-port", str(ports.http), "--grpc-port",
                                 str(ports.grpc), "--metrics-port", str(ports.metrics), "--timeout", "60"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and "exited with code" in error[0] and "onnxruntime" in error[0], result.output


@pytest.mark.slow
def test_serve_cli_prints_endpoints_answers_and_stops_on_ctrl_c(export_dir, local, tmp_path):
    import signal

    from t5compress.triton.client import generate

    repo = tmp_path / "repo"
    run(export_dir, TritonConfig(portable=True), repo)
    ports = Ports.free()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "t5compress.cli", "serve", str(repo), "--http-port", str(ports.http),
         "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("ready" in ln for ln in lines):
            lines.append(proc.stdout.readline())
        ready = next(ln for ln in lines if "ready" in ln)
        assert f"HTTP 127.0.0.1:{ports.http}" in ready and f"gRPC 127.0.0.1:{ports.grpc}" in ready
        server_pid = int(ready.split("pid ")[1].split(")")[0])
        assert generate(f"127.0.0.1:{ports.http}", "t5", ["q"]) == [local.generate_text(["q"])]
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "tritonserver stopped (exit code 0)" in rest
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


@pytest.mark.slow
def test_a_blockwise_int8_export_serves_what_the_local_runtime_generates(export_dir, tmp_path):
    """Block-wise int8 (MatMulNBits) packages and serves like any export: the server's ONNX Runtime runs it."""
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize
    from t5compress.runtime import load_runtime
    from t5compress.triton.client import generate

    int8 = tmp_path / "int8"
    quantize(export_dir, QuantizeConfig(mode="blockwise", min_agreement=0.5), int8, progress=False)
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(int8 / "decoder_with_past_model.onnx")).graph.node)
    run(int8, TritonConfig(name="t5", max_batch_size=8, max_input_tokens=40), tmp_path / "repo")
    running = start(find_server(), tmp_path / "repo", Ports.free(), log_path=tmp_path / "server.log")
    try:
        got = generate(running.http_url, "t5", TEXTS[:4], max_new_tokens=12)
    finally:
        assert running.stop() == 0
    assert got == [[t] for t in load_runtime(int8).generate_text(TEXTS[:4], max_new_tokens=12)]


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["in-process", "portable"])
def test_the_search_graph_serves_what_the_local_runtime_generates(export_dir, tmp_path, flavour):
    """--search-graph: the text model runs generator.onnx itself, or calls one generator leaf once per batch."""
    from t5compress.export.generator import write_generator
    from t5compress.runtime import load_runtime
    from t5compress.runtime.ingraph import finish
    from t5compress.runtime.settings import GenerationSettings
    from t5compress.triton.client import generate

    export = tmp_path / "export"
    shutil.copytree(export_dir, export)
    write_generator(export)
    repo = tmp_path / "repo"
    run(export, TritonConfig(name="t5", portable=flavour == "portable", search_graph=True, max_input_tokens=40), repo)
    models = _models(repo)
    if flavour == "portable":
        assert set(models) == {"t5", "t5_generator"} and models["t5_generator"].max_batch_size == 0
        assert (repo / "t5_generator" / "1" / "generator.onnx").is_file()
    else:
        assert set(models) == {"t5"} and (repo / "t5" / "1" / "generator.onnx").is_file()
        assert not (repo / "t5" / "1" / "decoder_with_past_model.onnx").exists()
    local = load_runtime(export, search="graph")
    running = start(find_server(), repo, Ports.free(), log_path=tmp_path / "server.log")
    try:
        for settings in (dict(max_new_tokens=12), dict(num_beams=3, num_return_sequences=2, max_new_tokens=10)):
            got = generate(running.http_url, "t5", TEXTS[:4], **settings)
            n = settings.get("num_return_sequences", 1)
            want = local.generate_text(TEXTS[:4], **settings)
            assert got == [want[k * n:(k + 1) * n] for k in range(4)], settings
        if flavour == "portable":  # a client that tokenizes itself calls the generator model alone, ids in and out
            ids, mask = local.encode(TEXTS[:4])
            got_ids = _call_generator(running.http_url, "t5_generator", ids, mask, beams=2, new_tokens=10)
            want_ids = local.generate(ids, mask, num_beams=2, max_new_tokens=10)
            assert got_ids.shape[:2] == (4, 1)
            np.testing.assert_array_equal(finish(got_ids[:, 0, :].astype(np.int64),
                                                 GenerationSettings(num_beams=2, max_new_tokens=10), local.tokens),
                                          want_ids)
    finally:
        assert running.stop() == 0


def _call_generator(url: str, model: str, ids: np.ndarray, mask: np.ndarray, beams: int, new_tokens: int):
    import tritonclient.http as http

    feeds = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
             "max_length": np.array([new_tokens + 1], np.int32), "min_length": np.array([1], np.int32),
             "num_beams": np.array([beams], np.int32), "num_return_sequences": np.array([1], np.int32),
             "length_penalty": np.array([1.0], np.float32), "repetition_penalty": np.array([1.0], np.float32)}
    client = http.InferenceServerClient(url)
    try:
        inputs = []
        for name, value in feeds.items():
            tensor = http.InferInput(name, list(value.shape), "INT32" if value.dtype == np.int32 else "FP32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return client.infer(model, inputs).as_numpy("sequences")
    finally:
        client.close()


def test_search_graph_repositories_refuse_what_they_cannot_serve(export_dir, tmp_path):
    with pytest.raises(ModelError, match="has no generator.onnx"):
        run(export_dir, TritonConfig(search_graph=True), tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    with pytest.raises(ConfigError, match="drop --search-graph or --inflight"):
        TritonConfig(search_graph=True, inflight=True)
