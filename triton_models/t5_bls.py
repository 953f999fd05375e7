"""Triton python model: text in, text out. Generation runs here; its graphs run here too (in-process, the default on
CPU: the cache never leaves this process), or in leaf models called through BLS at every step (`--leaves`).

Copied into a model repository as `<name>/1/model.py` by `t5compress triton`, beside the export's tokenizer and
config files and a copy of `t5compress.runtime` (and in-process, the graphs), so the server needs numpy,
onnxruntime and `tokenizers` only (no t5compress install). The same file serves every repository flavour: the leaf
models it calls are ONNX Runtime backend models, or python models running ONNX Runtime (`--portable`).

Its inputs and outputs are `t5compress.runtime.contract`'s (read and written with it). Requests that arrive together
(dynamic batching) are generated together by the scheduler's `batches` and `generate_batch`: one encoder call and one
decoder call per step for all of them, grouped by their generation settings, at most `max_batch_texts` texts at a time.
The config declares a far larger max_batch_size (see `t5compress.triton.repository.DECLARED_MAX_BATCH`) so that a
request holding more than `max_batch_texts` texts reaches this model, which refuses it with an error naming both sizes
and logs one line (Triton's own check would refuse it unlogged); the same declaration lets the dynamic batcher hand
over more than `max_batch_texts` texts at once when a queue has built up, and those are generated in turns.

Decoupled (`t5compress triton --inflight`): `execute` hands each request to a `runtime.scheduler.Scheduler` and
returns at once; the scheduler's thread answers through the request's response sender. On an export with the
in-flight layout (its graphs.json lists decoder_with_past_model's `attention_mask`), greedy requests join the
running batch at the next decoder step and leave when their own rows are done, and a request with `stream` true
gets a response per step with each text's new piece, then the final one; beam requests, and all requests on an
older export, are generated batch-at-a-time between steps. Clients use gRPC streaming.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the copy of t5compress.runtime beside this file

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by the python backend stub)

from t5compress.errors import first_line  # noqa: E402
from t5compress.names import GENERATOR_INPUTS, GENERATOR_OUTPUTS, GRAPHS, MANIFEST_FILE  # noqa: E402
from t5compress.runtime import GenerationSettings, Seq2SeqRuntime, contract, load_runtime  # noqa: E402
from t5compress.runtime.ingraph import GraphSearch, generator_entry  # noqa: E402
from t5compress.runtime.model import runtime_over  # noqa: E402
from t5compress.runtime.scheduler import Job, Result, Scheduler, batches, generate_batch  # noqa: E402
from t5compress.runtime.sessions import Backend  # noqa: E402

# Leaf models on a GPU (--kind gpu) answer with GPU tensors unless asked otherwise; the search runs in numpy.
_ON_CPU = ({"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
           if hasattr(pb_utils, "PreferredMemory") else {})


class BlsGraph:
    """`runtime.sessions.Graph` over BLS: feeds go to leaf model `name`, its outputs come back by name."""

    def __init__(self, name: str, input_names, output_names):
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = [pb_utils.Tensor(n, np.ascontiguousarray(feeds[n])) for n in self.input_names]
        response = pb_utils.InferenceRequest(
            model_name=self.name, requested_output_names=list(self.output_names), inputs=inputs, **_ON_CPU
        ).exec()
        if response.has_error():
            raise RuntimeError(f"leaf model {self.name}: {response.error().message()}")
        # Copies: the search reorders the cache in place, and the response's buffers go with the response.
        return {t.name(): np.array(t.as_numpy()) for t in response.output_tensors()}


def open_runtime(here: Path, params: dict[str, str]) -> Seq2SeqRuntime:
    """The graphs beside this file, run here (in-process); else a runtime over leaf models called through BLS: the
    generator once per batch (the search runs there), or the three graphs at every step."""
    if params.get("in_process") == "1":
        return load_runtime(here, threads=int(params.get("intra_op_thread_count", "1")), decoders="separate",
                            search=params.get("search", "python"))  # graph: generator.onnx runs the whole search
    if "generator_model" in params:
        runtime = runtime_over(here, None)
        runtime.graph_search = GraphSearch(generator_entry(here, with_file=False), BlsGraph(
            params["generator_model"], GENERATOR_INPUTS, GENERATOR_OUTPUTS))
        return runtime
    graphs = json.loads((here / MANIFEST_FILE).read_text())
    leaves = json.loads(params["leaf_models"])  # graph name -> leaf model name
    return runtime_over(here, Backend("triton", *(BlsGraph(leaves[g], graphs[g]["inputs"], graphs[g]["outputs"])
                                                  for g in GRAPHS)))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.runtime = open_runtime(Path(__file__).resolve().parent, params)
        self.runtime.tokenizer  # noqa: B018 -- load it now: a broken tokenizer fails the model load, not a request
        self.name = config["name"]
        # BATCH_PARAM of t5compress.triton.repository; the declared max_batch_size in a repository written before it
        self.max_batch = int(params.get("max_batch_texts", config.get("max_batch_size", 8)))
        self.max_beams = int(params.get("max_beams", "4"))
        self.max_new_tokens = int(params.get("max_new_tokens", "512"))
        limit = int(params.get("max_input_tokens", "-1"))  # -1: the export's own limit (tokenizer_config.json)
        self.max_input_tokens = None if limit < 0 else limit
        self.scheduler = None
        if params.get("decoupled") == "1":
            self.scheduler = Scheduler(self.runtime, int(params.get("max_inflight_rows", "32")),
                                       self.max_input_tokens)
            self.scheduler.start()
            how = "in-flight batching" if self.scheduler.inflight else "batch-at-a-time (export has no --inflight)"
            pb_utils.Logger.log_info(f"{config['name']}: decoupled, {how}")

    def finalize(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

    def execute(self, requests) -> list | None:
        """Decoupled: each request to the scheduler. Else the requests generated together, grouped by settings, at
        most max_batch texts at a time (a long queue's batch may hold more)."""
        if self.scheduler is not None:
            for request in requests:
                self._submit(request)
            return None
        responses: list = [None] * len(requests)
        jobs = []
        for i, request in enumerate(requests):
            try:
                texts, settings = self._parse(request)
            except Exception as e:  # noqa: BLE001 -- one bad request gets its error; the others in the batch go on
                if isinstance(e, contract.TooManyTexts):  # Triton's own check used to refuse it, unlogged: say it
                    pb_utils.Logger.log_warn(f"request {request.request_id() or '-'}: {first_line(e)}")
                responses[i] = _error(first_line(e))
                continue
            jobs.append(Job(texts, settings, ResponseSlot(responses, i)))
        for group in batches(jobs, self.max_batch):
            generate_batch(self.runtime, group, self.max_input_tokens)
        return responses

    def _submit(self, request) -> None:
        """Decoupled: queue the request with the scheduler, or answer its error now."""
        sink = SenderSink(request)
        try:
            texts, settings = self._parse(request)
            stream = contract.wants_stream(_getter(request))
        except Exception as e:  # noqa: BLE001 -- the request gets its error, the model goes on
            sink.fail(first_line(e))
            return
        self.scheduler.submit(Job(texts, settings, sink, stream))

    def _parse(self, request) -> tuple[list[str], GenerationSettings]:
        texts, given = contract.read_request(_getter(request), self.max_batch, self.name)
        settings = self.runtime.settings(**given)  # validates every field (one-line errors)
        if settings.num_beams > self.max_beams:
            raise ValueError(f"num_beams must be at most {self.max_beams} on this server, got {settings.num_beams}")
        if settings.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be at most {self.max_new_tokens} on this server, "
                             f"got {settings.max_new_tokens}")
        return texts, settings


def _getter(request):
    """A request's inputs by name, as numpy arrays (None: not sent)."""
    def get(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get


def _response(tensors: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in tensors.items()])


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class ResponseSlot:
    """`runtime.scheduler.Sink` that fills in one request's entry of `execute`'s responses."""

    def __init__(self, responses: list, index: int):
        self.responses, self.index = responses, index

    def done(self, result: Result) -> None:
        self.responses[self.index] = _response(contract.response(result))

    def fail(self, message: str) -> None:
        self.responses[self.index] = _error(message)

    def cancelled(self) -> bool:
        return False


class SenderSink:
    """`runtime.scheduler.Sink` over a decoupled request's response sender."""

    def __init__(self, request):
        self.request, self.sender = request, request.get_response_sender()
        self.id = request.request_id() or "-"

    def piece(self, texts: list[str]) -> None:
        self.sender.send(_response(contract.piece(texts)))

    def done(self, result: Result) -> None:
        self.sender.send(_response(contract.response(result)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def fail(self, message: str) -> None:
        pb_utils.Logger.log_warn(f"request {self.id}: {message}")
        if not self.cancelled():  # a cancelled request's sender takes no more responses
            self.sender.send(_error(message), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())
