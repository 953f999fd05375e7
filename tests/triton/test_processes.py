"""`t5compress.triton.processes` on plain processes (no server needed): how a dead child ended, a group ended whole."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest

from t5compress.triton import processes

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def test_a_killed_child_not_yet_reaped_says_how_it_ended():
    child = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        # forked, then running or in disk sleep while exec pages sleep(1) in: wait for it to be asleep in sleep(1)
        while (said := processes.how_it_ended(child.pid)) != "is sleeping":
            assert said in ("is running", "is disk sleep") and time.monotonic() < deadline
            time.sleep(0.01)
        assert processes.alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while processes.state(child.pid) != "zombie":  # not reaped: what a server that never waits leaves
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not processes.alive(child.pid)
        assert processes.how_it_ended(child.pid) == "killed by signal 9 (SIGKILL)"
    finally:
        child.kill()
        child.wait()
    assert processes.state(child.pid) == "gone" and processes.how_it_ended(child.pid) == "is gone"


def test_end_group_kills_every_process_of_the_group_and_removes_the_named_shared_memory(tmp_path):
    # a session leader with a child that ignores SIGTERM, as Triton's orphaned python processes do
    leader = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"], start_new_session=True)
    shm = processes.SHM_DIR / f"t5compress-test-{uuid.uuid4().hex}"
    shm.write_bytes(b"x")
    try:
        deadline = time.monotonic() + 10
        while len(processes.group(leader.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sorted(processes.tree(leader.pid)) == sorted(processes.group(leader.pid))
        left = processes.end_group(leader.pid, {shm.name, "not-there"})
        assert len(left["killed"]) == 2 and left["shm_removed"] == [shm.name] and not shm.exists()
        leader.wait(10)
        deadline = time.monotonic() + 10
        while processes.group(leader.pid):  # the child is reaped by init
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        leader.kill()
        leader.wait()
        shm.unlink(missing_ok=True)
