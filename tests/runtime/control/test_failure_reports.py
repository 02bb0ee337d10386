"""Failures say what happened: a mesh whose workers get a smaller MONARCH_MAX_FRAME through
`spawn_procs(env=...)` refuses an oversized call on the controller (naming that limit) instead of losing a
worker; a worker that exits with an error code is reported with the last line it wrote to stderr; kill -9
of a rank's monitor is reported as that rank's, not as the launcher's.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from monarch.actor import Actor, endpoint, this_host
from monarch.errors import SupervisionError, TransportError

T = 30.0
pytestmark = pytest.mark.slow


class Worker(Actor):
    @endpoint
    def echo(self, x: str) -> int:
        return len(x)

    @endpoint
    def pids(self) -> tuple[int, int]:
        return os.getpid(), os.getppid()

    @endpoint
    def die(self) -> None:
        sys.stderr.write("storage: the disk is on fire\n")
        sys.stderr.flush()
        os._exit(3)

    @endpoint
    def sleep(self, s: float) -> None:
        time.sleep(s)


def test_a_frame_limit_given_to_the_workers_is_the_meshs(faults: list) -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}, env={"MONARCH_MAX_FRAME": "4096"}) as procs:
        w = procs.spawn("framed", Worker)
        with pytest.raises(TransportError, match="4096"):
            w.echo.call("x" * 10_000).get(timeout=T)
        assert w.echo.call("x" * 100).get(timeout=T).values() == [100, 100]
    assert not faults


def test_an_error_exit_is_reported_with_its_last_words(faults: list) -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        w = procs.spawn("dying", Worker)
        w.slice(gpus=1).die.broadcast()
        with pytest.raises(SupervisionError, match="rank 1.*exited with code 3 after: storage: the disk is on fire"):
            w.sleep.call(T).get(timeout=T)


def test_kill_9_of_a_monitor_names_its_rank(faults: list) -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        w = procs.spawn("monitored", Worker)
        _, monitor = w.slice(gpus=1).pids.call_one().get(timeout=T)
        pending = w.sleep.call(T)
        os.kill(monitor, signal.SIGKILL)
        with pytest.raises(SupervisionError) as e:
            pending.get(timeout=T)
        assert "rank 1" in str(e.value) and f"monitor, pid {monitor}" in str(e.value), str(e.value)
        assert "launcher" not in str(e.value)
