"""A serving loop over one runtime: requests arrive at any time and leave as soon as their own rows are done.

On an in-flight export (export --inflight) greedy requests join the running `InflightBatch` at the next decoder step,
whatever their max_new_tokens or logits processors, and may stream: after every step a streaming request is told the
new text of each of its rows. Beam requests, and every request on an older export (its graphs.json says so), are
generated batch-at-a-time: those waiting together with the same settings as one `generate` call, on a second thread
once `start`ed (so a beam batch does not hold up the greedy rows' steps), inline in `run_once` otherwise.

    scheduler = Scheduler(runtime, max_rows=32)
    scheduler.start()                                      # a daemon thread runs the loop
    scheduler.submit(Job(["translate: hi"], runtime.settings(max_new_tokens=8), sink, stream=True))

A `Sink` receives the pieces, the result or one error line, and says whether its client went away; a client that
did is dropped at the next step, and the others in flight go on. The batch-at-a-time half stands alone too:
`batches` groups jobs by settings within a text limit and `generate_batch` runs a group (what the Triton text
model without --inflight does with each batch of requests Triton hands it).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from t5compress.errors import ConfigError, first_line
from t5compress.runtime.inflight import InflightBatch, Piece, supports_inflight
from t5compress.runtime.model import Seq2SeqRuntime
from t5compress.runtime.settings import GenerationSettings
from t5compress.runtime.text import Encoded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """A finished request: per text its strings (num_return_sequences) and token rows, and what was read of it."""

    texts: list[list[str]]
    ids: np.ndarray  # (texts, num_return_sequences, longest) int64, decoder start token first, pad-filled
    lengths: tuple[int, ...]  # tokens each text had before truncation (EOS included)
    truncated: tuple[bool, ...]


class Sink(Protocol):
    """Where one request's answers go (a Triton response sender, a test's list)."""

    def piece(self, texts: list[str]) -> None:
        """Streaming only: per text, the text decoded since the last piece (may be empty for some texts)."""

    def done(self, result: Result) -> None: ...

    def fail(self, message: str) -> None:
        """The request failed or was cancelled: one line; nothing else follows."""

    def cancelled(self) -> bool: ...


@dataclass
class Job:
    """One request: its texts, settings, where its answers go, and (filled by the scheduler) its progress."""

    texts: list[str]
    settings: GenerationSettings
    sink: Sink
    stream: bool = False
    key: int = -1
    encoded: Encoded | None = None
    rows: list[list[int]] = field(default_factory=list)  # per text: decoder start token, then its tokens
    finished: set[int] = field(default_factory=set)
    sent: list[str] = field(default_factory=list)  # per text: the text streamed so far


class Scheduler:
    """Admits jobs between decoder steps and runs the steps, on a thread of its own (`start`) or by `run_once`."""

    def __init__(self, runtime: Seq2SeqRuntime, max_rows: int = 32, max_input_tokens: int | None = None):
        if max_rows < 1:
            raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
        self.runtime, self.max_rows, self.max_input_tokens = runtime, max_rows, max_input_tokens
        self.engine = InflightBatch(runtime) if supports_inflight(runtime) else None
        self.active: dict[int, Job] = {}  # jobs with rows in the engine
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self._keys = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._batches: ThreadPoolExecutor | None = None  # batch-at-a-time groups, once started

    @property
    def inflight(self) -> bool:
        """Whether greedy requests join running batches (the export has the in-flight layout)."""
        return self.engine is not None

    def submit(self, job: Job) -> None:
        """Queue `job` (thread-safe); a request the scheduler cannot serve gets its error at once."""
        if job.stream and (job.settings.num_beams > 1 or not self.inflight):
            why = (f"num_beams is {job.settings.num_beams}: only greedy requests stream" if self.inflight else
                   "this export has no in-flight decoder (re-export with `t5compress export --inflight`)")
            _call(job, job.sink.fail, f"stream: {why}")
            return
        job.key = next(self._keys)
        with self._wake:
            self._queue.append(job)
            self._wake.notify()

    def start(self) -> None:
        self._batches = ThreadPoolExecutor(1, thread_name_prefix="t5compress-batches")
        self._thread = threading.Thread(target=self._loop, name="t5compress-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._batches is not None:
            self._batches.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self.run_once(block=True)
            except Exception as e:  # noqa: BLE001 -- the loop must outlive any one failure; its jobs get the error
                log.error("scheduler step failed: %s", first_line(e))
                self._fail_all(first_line(e))

    def run_once(self, block: bool = False) -> None:
        """Admit what is waiting (and fits), drop cancelled jobs, run one decoder step."""
        greedy, batch = self._take(block)
        for job in greedy:
            self._join(job)
        for group in batches(batch):
            if self._batches is not None:  # ONNX Runtime sessions run concurrently
                self._batches.submit(generate_batch, self.runtime, group, self.max_input_tokens)
            else:
                generate_batch(self.runtime, group, self.max_input_tokens)
        self._drop_cancelled()
        if self.engine is not None and self.engine.rows:
            self._emit(self.engine.step())

    def _take(self, block: bool) -> tuple[list[Job], list[Job]]:
        """Waiting jobs: greedy ones for the engine while rows fit (a first one always does), the others all."""
        with self._wake:
            if block and not self._queue and not (self.engine is not None and self.engine.rows):
                self._wake.wait(0.5)
            greedy, batch, kept = [], [], deque()
            rows = len(self.engine.rows) if self.engine is not None else 0
            while self._queue:
                job = self._queue.popleft()
                if self.engine is None or job.settings.num_beams > 1:
                    batch.append(job)
                elif rows == 0 or rows + len(job.texts) <= self.max_rows:
                    greedy.append(job)
                    rows += len(job.texts)
                else:
                    kept.append(job)  # in order: the next step frees rows
            self._queue.extend(kept)
        return greedy, batch

    def _join(self, job: Job) -> None:
        if job.sink.cancelled():
            _call(job, job.sink.fail, "request cancelled before it started")
            return
        start = self.runtime.tokens.decoder_start
        try:
            job.encoded = self.runtime.tokenize(job.texts, self.max_input_tokens)
            job.rows = [[start] for _ in job.texts]
            job.sent = ["" for _ in job.texts]
            self.active[job.key] = job
            pieces = self.engine.add(job.key, job.encoded.input_ids, job.encoded.attention_mask, job.settings)
        except Exception as e:  # noqa: BLE001 -- one request's error (too long, too big for memory) is its own
            self._drop(job, first_line(e))
            return
        self._emit(pieces)

    def _emit(self, pieces: list[Piece]) -> None:
        """Record each new token; stream the new text; finish jobs whose rows are all done."""
        touched: dict[int, Job] = {}
        for p in pieces:
            job = self.active.get(p.key)
            if job is None:
                continue
            job.rows[p.row].append(p.token)
            if p.done:
                job.finished.add(p.row)
            touched[job.key] = job
        for job in touched.values():
            if job.stream:
                self._stream(job)
            if len(job.finished) == len(job.rows) and self.active.pop(job.key, None) is not None:
                _call(job, job.sink.done, self._result(job))

    def _stream(self, job: Job) -> None:
        full = self.runtime.tokenizer.decode(job.rows)
        new = []
        for i, text in enumerate(full):
            # A token can end inside a character (byte-level vocabularies): hold that back until it is whole.
            text = text.rstrip("\ufffd")
            grown = text.startswith(job.sent[i]) and len(text) > len(job.sent[i])
            new.append(text[len(job.sent[i]):] if grown else "")
            job.sent[i] = text if grown else job.sent[i]
        if any(new) and not _call(job, job.sink.piece, new):
            self._drop(job, None)

    def _result(self, job: Job) -> Result:
        width = max(len(r) for r in job.rows)
        ids = np.full((len(job.rows), 1, width), self.runtime.tokens.pad, dtype=np.int64)
        for i, r in enumerate(job.rows):
            ids[i, 0, :len(r)] = r
        texts = [[t] for t in self.runtime.decode(ids[:, 0])]
        return Result(texts, ids, job.encoded.lengths, job.encoded.truncated)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.active.values() if j.sink.cancelled()]:
            self._drop(job, "request cancelled while generating")

    def _drop(self, job: Job, message: str | None) -> None:
        """Take `job`'s rows out of the batch; tell its sink why (None: it cannot be told)."""
        self.active.pop(job.key, None)
        if self.engine is not None:
            self.engine.cancel(job.key)
        if message is not None:
            _call(job, job.sink.fail, message)

    def _fail_all(self, message: str) -> None:
        for job in list(self.active.values()):
            _call(job, job.sink.fail, message)
        self.active.clear()
        if self.engine is not None:
            self.engine = InflightBatch(self.runtime)  # a fresh, empty batch: the failed one's state is unknown


def _call(job: Job, fn: Callable, *args) -> bool:
    """Call a sink; a sink that raises (its client is gone) is logged in one line. Returns whether it worked."""
    try:
        fn(*args)
        return True
    except Exception as e:  # noqa: BLE001 -- a sink's failure is that request's, never the loop's
        log.warning("request %d: cannot deliver its answer: %s", job.key, first_line(e))
        return False


def batches(jobs: list[Job], max_texts: int | None = None) -> list[list[Job]]:
    """`jobs` grouped by their settings (in order of arrival), each group in consecutive runs of whole jobs holding
    at most `max_texts` texts together (None: no limit; a job holding more runs alone)."""
    groups: dict[GenerationSettings, list[list[Job]]] = {}
    for j in jobs:
        runs = groups.setdefault(j.settings, [[]])
        if runs[-1] and max_texts is not None and sum(len(k.texts) for k in runs[-1]) + len(j.texts) > max_texts:
            runs.append([])
        runs[-1].append(j)
    return [run for runs in groups.values() for run in runs]


def generate_batch(runtime: Seq2SeqRuntime, jobs: list[Job], max_input_tokens: int | None = None) -> None:
    """Jobs with the same settings as one batch-at-a-time `generate` call; each sink gets its result or the error."""
    for j in [j for j in jobs if j.sink.cancelled()]:
        _call(j, j.sink.fail, "request cancelled before it started")
    jobs = [j for j in jobs if not j.sink.cancelled()]
    if not jobs:
        return
    texts = [t for j in jobs for t in j.texts]
    s = jobs[0].settings
    try:
        enc = runtime.tokenize(texts, max_input_tokens)
        out = runtime.generate(enc.input_ids, enc.attention_mask, **s.__dict__)  # (texts * n, len)
    except Exception as e:  # noqa: BLE001 -- the group's requests get the error, the server goes on
        for j in jobs:
            _call(j, j.sink.fail, first_line(e))
        return
    n, at = s.num_return_sequences, 0
    decoded = runtime.decode(out)
    for j in jobs:
        k = len(j.texts)
        ids = crop(out[at * n:(at + k) * n].reshape(k, n, -1), runtime.tokens.eos)
        texts = [decoded[(at + i) * n:(at + i + 1) * n] for i in range(k)]
        _call(j, j.sink.done, Result(texts, ids, enc.lengths[at:at + k], enc.truncated[at:at + k]))
        at += k


def crop(ids: np.ndarray, eos: tuple[int, ...]) -> np.ndarray:
    """(texts, n, len) ids of one request cut to its own longest row: what generating it alone returns.

    A row is as long as the start token plus its tokens up to the first EOS, or the whole width if it has none; rows
    generated together with longer ones (other requests of the batch) are only padded after that, with the
    runtime's fill value, which the cut keeps.
    """
    hit = np.isin(ids[..., 1:], list(eos))
    lengths = np.where(hit.any(axis=-1), hit.argmax(axis=-1) + 2, ids.shape[-1])
    return ids[..., : int(lengths.max())]
