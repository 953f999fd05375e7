"""Clients of a served text model: one call (`generate`) and a bounded load test (`measure`) over HTTP or gRPC.

    generate("127.0.0.1:8000", "t5", ["translate: hi"], num_beams=4)  -> [["..."]]
    measure("127.0.0.1:8000", "t5", "http", concurrency=8, requests=200, texts=[...])  -> latency percentiles

Each client thread owns its connection (tritonclient's clients are not shared between threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5compress.errors import ConfigError, T5CompressError, first_line
from t5compress.triton.repository import GENERATION_INPUTS

log = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_STRING": np.object_}
WIRE_TYPES = {"TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_STRING": "BYTES"}


class ClientError(T5CompressError):
    """The server cannot be reached, or it answered a request with an error."""


def _module(protocol: str):
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
    try:
        if protocol == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
    except ImportError as e:
        raise ConfigError(f"the Triton client needs tritonclient[{protocol}] ({e.name} is missing): "
                          "pip install 't5compress[triton]'") from None
    return module


def connect(url: str, protocol: str = "http"):
    """A client for `url` (host:port; an http:// prefix is dropped), checked to answer as live."""
    module = _module(protocol)
    url = url.removeprefix("http://").removeprefix("https://").rstrip("/")
    try:
        client = module.InferenceServerClient(url)
        live = client.is_server_live()
    except Exception as e:  # tritonclient raises InferenceServerException, socket and gevent errors
        raise ClientError(f"no Triton server answers {protocol} at {url}: {first_line(e)}") from None
    if not live:
        raise ClientError(f"the Triton server at {url} is not live")
    return client


def inputs(protocol: str, texts: Sequence[str], **settings: Any) -> list:
    """TEXT (batch, 1) and one (batch, 1) tensor per given generation setting."""
    module = _module(protocol)
    unknown = sorted(set(settings) - set(GENERATION_INPUTS))
    if unknown:
        raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; "
                          f"valid: {', '.join(GENERATION_INPUTS)}")
    out = []
    text = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))
    out.append(text)
    for name, value in settings.items():
        if value is None:
            continue
        kind = GENERATION_INPUTS[name]
        tensor = module.InferInput(name, [len(texts), 1], WIRE_TYPES[kind])
        v = str(value).lower().encode() if kind == "TYPE_STRING" else value
        tensor.set_data_from_numpy(np.full((len(texts), 1), v, dtype=NUMPY_TYPES[kind]))
        out.append(tensor)
    return out


def infer(client, protocol: str, model: str, texts: Sequence[str], **settings: Any) -> list[list[str]]:
    """One request; per text its num_return_sequences outputs."""
    try:
        result = client.infer(model, inputs(protocol, texts, **settings))
    except T5CompressError:
        raise
    except Exception as e:  # InferenceServerException carries the server's message
        raise ClientError(f"{model}: {first_line(e)}") from None
    return [[t.decode("utf-8") for t in row] for row in result.as_numpy("OUTPUT_TEXT")]


def generate(url: str, model: str, texts: Sequence[str], protocol: str = "http", **settings: Any) -> list[list[str]]:
    client = connect(url, protocol)
    try:
        return infer(client, protocol, model, texts, **settings)
    finally:
        client.close()


def measure(url: str, model: str, protocol: str, concurrency: int, requests: int, texts: Sequence[str],
            warmup: int = 2, **settings: Any) -> dict[str, Any]:
    """`requests` single-text requests from `concurrency` threads (texts taken in turn); latency and throughput."""
    if concurrency < 1 or requests < 1 or not texts:
        raise ConfigError("measure needs concurrency >= 1, requests >= 1 and at least one text")
    warm = connect(url, protocol)
    for k in range(warmup):
        infer(warm, protocol, model, [texts[k % len(texts)]], **settings)
    warm.close()
    latencies: list[float] = []
    errors: list[str] = []
    counter = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        client = connect(url, protocol)
        try:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                t0 = time.perf_counter()
                try:
                    infer(client, protocol, model, [texts[k % len(texts)]], **settings)
                except ClientError as e:
                    with lock:
                        errors.append(str(e))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t0)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ms = np.array(latencies) * 1000.0
    pct = {f"p{q}_ms": round(float(np.percentile(ms, q)), 1) if ms.size else None for q in (50, 90, 99)}
    return {"protocol": protocol, "concurrency": concurrency, "requests": requests, "ok": len(latencies),
            "errors": len(errors), "first_error": errors[0] if errors else None, **pct,
            "throughput_rps": round(len(latencies) / wall, 2), "seconds": round(wall, 2)}


def batch_statistics(url: str, model: str) -> dict[str, int]:
    """The server's counters for `model` (over HTTP): inferences (requests) and executions (batches run)."""
    client = connect(url, "http")
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    entry = stats["model_stats"][0]
    return {"inference_count": int(entry["inference_count"]), "execution_count": int(entry["execution_count"])}
