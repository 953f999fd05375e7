"""Triton python model: text in, text out. Generation runs here; its graphs run here too (in-process, the default on
CPU: the cache never leaves this process), or in leaf models called through BLS at every step (`--leaves`).

Copied into a model repository as `<name>/1/model.py` by `t5compress triton`, beside the export's tokenizer and
config files and a copy of `t5compress.runtime` (and in-process, the graphs), so the server needs numpy,
onnxruntime and `tokenizers` only (no t5compress install). The same file serves every repository flavour: the leaf
models it calls are ONNX Runtime backend models, or python models running ONNX Runtime (`--portable`).

Requests that arrive together (dynamic batching) are generated together: one encoder call and one decoder call per
step for all of them, grouped by their generation settings, at most `max_batch_texts` texts at a time. The config
declares a far larger max_batch_size (see `t5compress.triton.repository.DECLARED_MAX_BATCH`) so that a request
holding more than `max_batch_texts` texts reaches this model, which refuses it with an error naming both sizes and
logs one line (Triton's own check would refuse it unlogged); the same declaration lets the dynamic batcher hand over
more than `max_batch_texts` texts at once when a queue has built up, and those are generated in turns.

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

from t5compress.names import GENERATOR_INPUTS, GENERATOR_OUTPUTS  # noqa: E402
from t5compress.runtime import GenerationSettings, Seq2SeqRuntime, load_runtime  # noqa: E402
from t5compress.runtime.ingraph import GraphSearch, generator_entry  # noqa: E402
from t5compress.runtime.scheduler import Job, Result, Scheduler, crop  # noqa: E402
from t5compress.runtime.sessions import Backend  # noqa: E402
from t5compress.runtime.settings import read_generation_defaults  # noqa: E402

TEXT = "TEXT"
OUTPUT_TEXT = "OUTPUT_TEXT"
OUTPUT_IDS = "OUTPUT_IDS"
INPUT_TOKENS = "INPUT_TOKENS"  # per text: its tokens before truncation (EOS included)
TRUNCATED = "TRUNCATED"  # per text: whether it was cut to the model's input limit
STREAM = "stream"  # decoupled model only: BOOL, true for a response per decoder step (greedy)
# Optional request inputs: the GenerationSettings field each one sets, and how to read its value.
SETTINGS = {
    "max_new_tokens": int,
    "min_new_tokens": int,
    "num_beams": int,
    "num_return_sequences": int,
    "no_repeat_ngram_size": int,
    "length_penalty": float,
    "repetition_penalty": float,
    "early_stopping": lambda v: {"true": True, "false": False}.get(_text(v).lower(), _text(v).lower()),
}


# Leaf models on a GPU (--kind gpu) answer with GPU tensors unless asked otherwise; the search runs in numpy.
_ON_CPU = ({"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
           if hasattr(pb_utils, "PreferredMemory") else {})


class TooManyTexts(ValueError):
    """A request holding more texts than the model's real max batch size."""


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


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


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        here = Path(__file__).resolve().parent
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if params.get("in_process") == "1":  # the graphs beside this file, run here
            search = params.get("search", "python")  # graph: generator.onnx beside this file runs the whole search
            self.runtime = load_runtime(here, threads=int(params.get("intra_op_thread_count", "1")),
                                        decoders="separate", search=search)
        elif "generator_model" in params:  # one call of the generator leaf per batch: the search runs there
            tokens, defaults = read_generation_defaults(here)
            self.runtime = Seq2SeqRuntime(here, None, tokens, defaults)
            self.runtime.graph_search = GraphSearch(generator_entry(here, with_file=False), BlsGraph(
                params["generator_model"], GENERATOR_INPUTS, GENERATOR_OUTPUTS))
        else:
            graphs = json.loads((here / "graphs.json").read_text())
            leaves = json.loads(params["leaf_models"])  # graph name -> leaf model name
            backend = Backend("triton", *(BlsGraph(leaves[g], graphs[g]["inputs"], graphs[g]["outputs"])
                                          for g in ("encoder_model", "decoder_model", "decoder_with_past_model")))
            tokens, defaults = read_generation_defaults(here)
            self.runtime = Seq2SeqRuntime(here, backend, tokens, defaults)
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
        if self.scheduler is not None:
            for request in requests:
                self._submit(request)
            return None
        responses: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[str]]]] = {}
        for i, request in enumerate(requests):
            try:
                texts, settings = self._parse(request)
            except Exception as e:  # noqa: BLE001 -- one bad request gets its error; the others in the batch go on
                if isinstance(e, TooManyTexts):  # Triton's own check used to refuse it, unlogged: say it here
                    pb_utils.Logger.log_warn(f"request {request.request_id() or '-'}: {_line(e)}")
                responses[i] = _error(e)
                continue
            groups.setdefault(tuple(sorted(settings.items())), []).append((i, texts))
        for key, members in groups.items():
            for batch in batches_within(members, self.max_batch):  # a long queue's batch: max_batch texts at a time
                self._answer(batch, dict(key), responses)
        return responses

    def _answer(self, members: list[tuple[int, list[str]]], settings: dict, responses: list) -> None:
        """Generate the texts of `members` (request index, its texts) together; fill in their responses."""
        try:
            outputs = self._generate([t for _, texts in members for t in texts], settings)
        except Exception as e:  # noqa: BLE001 -- a failed group fails its own requests only
            for i, _ in members:
                responses[i] = _error(e)
            return
        start = 0
        for i, texts in members:
            strings, ids, lengths, cut = (o[start:start + len(texts)] for o in outputs)
            responses[i] = _response(strings, crop(np.stack(ids), self.runtime.tokens.eos), lengths, cut)
            start += len(texts)

    def _submit(self, request) -> None:
        """Decoupled: queue the request with the scheduler, or answer its error now."""
        sink = SenderSink(request)
        try:
            texts, settings = self._parse(request)
            tensor = pb_utils.get_input_tensor_by_name(request, STREAM)
            stream = tensor is not None and bool(tensor.as_numpy().reshape(-1).any())
        except Exception as e:  # noqa: BLE001 -- the request gets its error, the model goes on
            sink.fail(_line(e))
            return
        self.scheduler.submit(Job(texts, GenerationSettings(**settings), sink, stream))

    def _parse(self, request) -> tuple[list[str], dict]:
        tensor = pb_utils.get_input_tensor_by_name(request, TEXT)
        if tensor is None:  # Triton passes a request without its one required input to the model
            raise ValueError(f"input {TEXT} is missing: send the text to generate from as {TEXT} (BYTES, [batch, 1])")
        raw = tensor.as_numpy()  # (batch, 1) bytes
        if raw.shape[0] > self.max_batch:
            raise TooManyTexts(
                f"{self.name}: a request may hold at most {self.max_batch} texts (max batch size), this one holds "
                f"{raw.shape[0]}: split it into requests of at most {self.max_batch}, or write the repository again "
                "with a larger `t5compress triton --max-batch-size`")
        texts = [_text(v) for v in raw.reshape(-1)]
        if any(not t.strip() for t in texts):
            raise ValueError(f"{TEXT} is empty: send the text to generate from")
        settings = {}
        for name, parse in SETTINGS.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            values = {parse(v) for v in tensor.as_numpy().reshape(-1).tolist()}
            if len(values) != 1:
                raise ValueError(f"{name} must hold one value per request, got {sorted(map(str, values))}")
            settings[name] = values.pop()
        settings = {**self.runtime.settings(**settings).__dict__}  # validates every field (one-line errors)
        if settings["num_beams"] > self.max_beams:
            raise ValueError(f"num_beams must be at most {self.max_beams} on this server, got {settings['num_beams']}")
        if settings["max_new_tokens"] > self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be at most {self.max_new_tokens} on this server, "
                             f"got {settings['max_new_tokens']}")
        return texts, settings

    def _generate(self, texts: list[str], settings: dict) -> tuple[list, list, list, list]:
        """Per text: its num_return_sequences strings and token-id rows, its token count and whether it was cut."""
        enc = self.runtime.tokenize(texts, self.max_input_tokens)
        out = self.runtime.generate(enc.input_ids, enc.attention_mask, **settings)  # (len(texts) * n, out_len)
        n = settings["num_return_sequences"]
        decoded = self.runtime.decode(out)
        return ([decoded[k * n:(k + 1) * n] for k in range(len(texts))],
                [out[k * n:(k + 1) * n] for k in range(len(texts))], list(enc.lengths), list(enc.truncated))


def batches_within(members: list[tuple[int, list[str]]], limit: int) -> list[list[tuple[int, list[str]]]]:
    """Consecutive runs of `members` (request index, its texts) holding at most `limit` texts each (no member holds
    more: `_parse` refuses it)."""
    out: list[list[tuple[int, list[str]]]] = []
    count = 0
    for member in members:
        if not out or count + len(member[1]) > limit:
            out.append([])
            count = 0
        out[-1].append(member)
        count += len(member[1])
    return out


def _response(texts: list[list[str]], ids: np.ndarray, lengths: list[int], cut: list[bool]):
    """texts: per text its n strings; ids: (batch, n, longest) int64; lengths, cut: per text."""
    text = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=np.object_)  # (batch, n)
    ids = np.ascontiguousarray(ids)
    return pb_utils.InferenceResponse([
        pb_utils.Tensor(OUTPUT_TEXT, text), pb_utils.Tensor(OUTPUT_IDS, ids),
        pb_utils.Tensor(INPUT_TOKENS, np.array(lengths, dtype=np.int64).reshape(-1, 1)),
        pb_utils.Tensor(TRUNCATED, np.array(cut, dtype=np.bool_).reshape(-1, 1)),
    ])


def _line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else repr(e)


def _error(e: Exception):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(_line(e)))


class SenderSink:
    """`runtime.scheduler.Sink` over a decoupled request's response sender."""

    def __init__(self, request):
        self.request, self.sender = request, request.get_response_sender()
        self.id = request.request_id() or "-"

    def piece(self, texts: list[str]) -> None:
        text = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)  # (batch, 1): the new text
        self.sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(OUTPUT_TEXT, text)]))

    def done(self, result: Result) -> None:
        response = _response(result.texts, result.ids, list(result.lengths), list(result.truncated))
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def fail(self, message: str) -> None:
        pb_utils.Logger.log_warn(f"request {self.id}: {message}")
        if not self.cancelled():  # a cancelled request's sender takes no more responses
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())
