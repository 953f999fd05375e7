"""Clients of a served text model: one call (`generate`) and a bounded load test (`measure`) over HTTP or gRPC.

    generate("127.0.0.1:8000", "t5", ["translate: hi"], num_beams=4)  -> [["..."]]
    measure("127.0.0.1:8000", "t5", "http", concurrency=8, requests=200, texts=[...])  -> latency percentiles
    stream_infer(connect("127.0.0.1:8001", "grpc"), "t5", ["hi"])  -> pieces as decoded, then the texts

A decoupled text model (`t5compress triton --inflight`) answers over gRPC streams only: `stream_infer`, or the
`grpc-stream` protocol of `measure`, which also times the first streamed piece and the pieces after it.

Each client thread owns its connection (tritonclient's clients are not shared between threads).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from t5compress.errors import ConfigError, T5CompressError, first_line
from t5compress.runtime import contract

log = logging.getLogger(__name__)

STREAMING = "grpc-stream"  # gRPC streaming with `stream` true: a decoupled model's pieces as they are decoded
PROTOCOLS = ("http", "grpc", STREAMING)


class ClientError(T5CompressError):
    """The server cannot be reached, or it answered a request with an error."""


def _module(protocol: str):
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
    protocol = "grpc" if protocol == STREAMING else protocol
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


def inputs(protocol: str, texts: Sequence[str], stream: bool | None = None, **settings: Any) -> list:
    """TEXT (batch, 1), one (batch, 1) tensor per given generation setting, and `stream` when given."""
    module = _module(protocol)
    out = []
    for tensor, values in contract.request(texts, stream, **settings):
        wire = module.InferInput(tensor.name, list(values.shape), tensor.datatype)
        wire.set_data_from_numpy(values)
        out.append(wire)
    return out


def infer(client, protocol: str, model: str, texts: Sequence[str], **settings: Any) -> list[list[str]]:
    """One request; per text its num_return_sequences outputs."""
    try:
        result = client.infer(model, inputs(protocol, texts, **settings))
    except T5CompressError:
        raise
    except Exception as e:  # InferenceServerException carries the server's message
        raise ClientError(f"{model}: {first_line(e)}") from None
    return contract.texts_of(result.as_numpy(contract.OUTPUT_TEXT.name))


@dataclass(frozen=True)
class Streamed:
    """A decoupled model's answer: the final texts, and the pieces streamed before them with their times."""

    texts: list[list[str]]  # per text, its num_return_sequences outputs
    pieces: list[list[str]]  # per streamed response, the new text of each input text
    piece_seconds: list[float]  # when each piece arrived, seconds after the request was sent
    seconds: float  # when the final response arrived


def stream_infer(client, model: str, texts: Sequence[str], stream: bool = True, timeout: float = 120.0,
                 **settings: Any) -> Streamed:
    """One request to a decoupled model over a gRPC stream of `client` (a tritonclient.grpc client)."""
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), result, error)))
        started = time.perf_counter()
        client.async_stream_infer(model, inputs("grpc", texts, stream, **settings), enable_empty_final_response=True)
        pieces, times, final = [], [], None
        while True:
            try:
                at, result, error = answers.get(timeout=timeout)
            except queue.Empty:
                raise ClientError(f"{model}: no answer within {timeout:.0f} s") from None
            if error is not None:
                raise ClientError(f"{model}: {first_line(error)}")
            text = result.as_numpy(contract.OUTPUT_TEXT.name)
            if result.as_numpy(contract.OUTPUT_IDS.name) is not None:
                final = contract.texts_of(text)
            elif text is not None:
                pieces.append([t for row in contract.texts_of(text) for t in row])
                times.append(at - started)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except T5CompressError:
        raise
    except Exception as e:  # InferenceServerException, grpc errors
        raise ClientError(f"{model}: {first_line(e)}") from None
    finally:
        client.stop_stream()
    if final is None:
        raise ClientError(f"{model}: the stream ended without a final answer")
    return Streamed(final, pieces, times, at - started)


def generate(url: str, model: str, texts: Sequence[str], protocol: str = "http", **settings: Any) -> list[list[str]]:
    client = connect(url, protocol)
    try:
        return infer(client, protocol, model, texts, **settings)
    finally:
        client.close()


def measure(url: str, model: str, protocol: str, concurrency: int, requests: int, texts: Sequence[str],
            warmup: int = 2, max_seconds: float | None = None, **settings: Any) -> dict[str, Any]:
    """`requests` single-text requests from `concurrency` threads (texts taken in turn); latency, throughput, errors
    and empty answers. With `max_seconds`, no request is sent after that many seconds (a soak bounded in time)."""
    if concurrency < 1 or requests < 1 or not texts:
        raise ConfigError("measure needs concurrency >= 1, requests >= 1 and at least one text")
    warm = connect(url, protocol)
    for k in range(warmup):
        _timed(warm, protocol, model, texts[k % len(texts)], settings)
    warm.close()
    latencies: list[float] = []
    errors: list[str] = []
    empty = [0]
    counter = iter(range(requests))
    lock = threading.Lock()
    started = time.perf_counter()
    deadline = started + max_seconds if max_seconds else float("inf")

    def worker() -> None:
        client = connect(url, protocol)
        try:
            while True:
                with lock:
                    k = next(counter, None) if time.perf_counter() < deadline else None
                if k is None:
                    return
                try:
                    timing, blank = _timed(client, protocol, model, texts[k % len(texts)], settings)
                except ClientError as e:
                    with lock:
                        errors.append(str(e))
                    continue
                with lock:
                    latencies.append(timing)
                    empty[0] += blank
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    pct = _percentiles(latencies)
    return {"protocol": protocol, "concurrency": concurrency, "requests": requests, "ok": len(latencies),
            "errors": len(errors), "first_error": errors[0] if errors else None, "empty": empty[0],
            "sent": len(latencies) + len(errors), **pct,
            "throughput_rps": round(len(latencies) / wall, 2), "seconds": round(wall, 2)}


def _timed(client, protocol: str, model: str, text: str, settings: dict) -> tuple[tuple[float, ...], bool]:
    """((seconds,), empty) of one request; streamed: ((seconds, first piece's seconds, seconds per later piece),
    empty); empty: the answer holds no text."""
    if protocol != STREAMING:
        t0 = time.perf_counter()
        out = infer(client, protocol, model, [text], **settings)
        return (time.perf_counter() - t0,), not any(o.strip() for row in out for o in row)
    got = stream_infer(client, model, [text], **settings)
    times = got.piece_seconds or [got.seconds]
    per_piece = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return (got.seconds, times[0], per_piece), not any(o.strip() for row in got.texts for o in row)


def _percentiles(timings: list[tuple[float, ...]]) -> dict[str, float | None]:
    """p50/p90/p99 of latency in ms; for streams also the first piece's p50/p90 and the p50 ms per later piece."""
    ms = np.array([t[0] for t in timings]) * 1000.0
    out = {f"p{q}_ms": round(float(np.percentile(ms, q)), 1) if ms.size else None for q in (50, 90, 99)}
    if timings and len(timings[0]) == 3:
        first = np.array([t[1] for t in timings]) * 1000.0
        per = np.array([t[2] for t in timings if t[2] == t[2]]) * 1000.0
        out.update({f"first_piece_p{q}_ms": round(float(np.percentile(first, q)), 1) for q in (50, 90)})
        out["ms_per_piece_p50"] = round(float(np.median(per)), 2) if per.size else None
    return out


def batch_statistics(url: str, model: str) -> dict[str, int]:
    """The server's counters for `model` (over HTTP): inferences (requests) and executions (batches run)."""
    client = connect(url, "http")
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    entry = stats["model_stats"][0]
    return {"inference_count": int(entry["inference_count"]), "execution_count": int(entry["execution_count"])}


def server_rss_mb(url: str) -> float | None:
    """Resident memory in MB of the local process listening on `url`'s port plus all its descendants (tritonserver
    and its python backend stubs), read from /proc; None when no local process listens there (a remote server)."""
    try:
        port = int(url.removeprefix("http://").rsplit(":", 1)[1])
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                    inodes.add(f[9])
    except (OSError, ValueError, IndexError):
        return None
    procs = {}  # pid -> (parent pid, rss pages)
    owner = None
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            procs[int(d.name)] = (int(stat[1]), int(stat[21]))
            if owner is None and any(os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes
                                     for fd in (d / "fd").iterdir()):
                owner = int(d.name)
        except (OSError, ValueError, IndexError):
            continue
    if owner is None:
        return None
    tree, grew = {owner}, True
    while grew:
        more = {p for p, (parent, _) in procs.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return round(sum(procs[p][1] for p in tree if p in procs) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
