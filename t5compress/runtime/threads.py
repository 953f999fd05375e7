"""How the runtime's ONNX Runtime sessions use CPU threads: the intra-op count a caller gets by default, and the
thread-pool settings per count.

With more than one intra-op thread, the pool's workers spin while a run lasts and sleep as soon as it returns
(`SPIN_IN_RUN`). A batch-1 decoder step hands the pool ~60 matrix-vector products of a few hundred KB of weights,
tens of µs each: a sleeping worker, woken for each, arrived after the main thread had done its half, and 2 threads ran
a step no faster than 1 (the settings before, `NO_SPIN`). ONNX Runtime's default spinning keeps each session's
workers busy for ~50 ms after every run, and the runtime's three sessions (encoder, first step, with-past step) then
spin against each other and the Python search on 2 cores (0.7-0.8x of 1 thread on the 2-vCPU VMs);
`session.force_spinning_stop` ends the spin when the run returns. Measured in docs/benchmarks.md ("Threads").
"""

from __future__ import annotations

import os
from pathlib import Path

SPIN_IN_RUN = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
NO_SPIN = {"session.intra_op.allow_spinning": "0"}
MAX_DEFAULT_THREADS = 8  # measured on 2 vCPUs only: larger machines get at most this many until measured there


def pool_entries(threads: int) -> dict[str, str]:
    """Session config entries for `threads` intra-op threads (0: ONNX Runtime's default, one per physical core); one
    setting for every graph (a with-past pool of its own that spins between steps measured no better)."""
    return dict(NO_SPIN if threads == 1 else SPIN_IN_RUN)


def physical_cores(cpus: set[int] | None = None, sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Cores this process may run on, SMT siblings counted once (Linux topology files; the CPU count elsewhere)."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        siblings = sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(len(cores), 1)


def default_threads() -> int:
    """The intra-op thread count `--threads` defaults to: one per physical core this process may use, at most
    `MAX_DEFAULT_THREADS` (on the 2-vCPU VMs, 2 threads beat 1 at batch 1 and 8 with `SPIN_IN_RUN`)."""
    return min(physical_cores(), MAX_DEFAULT_THREADS)
