"""Heartbeats: a stopped worker fails its mesh, a busy one does not, and neither does a paused controller."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from processes import owned_processes

import monarch
from monarch.actor import Actor, endpoint, this_host
from monarch.errors import SupervisionError
from monarch.runtime.control.controller import controller

TIMEOUT = 1.5  # MONARCH_HEARTBEAT_TIMEOUT of the meshes these tests spawn
MARGIN = 2.0  # detection may take this much longer than the timeout on a loaded machine
T = 30
pytestmark = pytest.mark.slow  # each test starts its own meshes


class Busy(Actor):
    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def spin(self, seconds: float) -> int:
        """Pure Python that never blocks: the heartbeat thread gets the GIL only by the interpreter's
        thread switching."""
        n, until = 0, time.monotonic() + seconds
        while time.monotonic() < until:
            n += 1
        return n

    @endpoint
    def matmuls(self, seconds: float, a: torch.Tensor) -> int:
        """torch kernels (the tensor argument loads torch while its call is decoded, excused by Busy)."""
        n, until = 0, time.monotonic() + seconds
        while time.monotonic() < until:
            a = torch.tanh(a @ a)
            n += 1
        return n


@pytest.fixture
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Meshes spawned in the test get MONARCH_HEARTBEAT_TIMEOUT=TIMEOUT (the controller reads it at spawn)."""
    monkeypatch.setenv("MONARCH_HEARTBEAT_TIMEOUT", str(TIMEOUT))


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids the test SIGSTOPs; continued afterwards, so that nothing is left stopped."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def get_in_thread(fut: object, limit: float) -> tuple[BaseException | None, float]:
    """`fut.get()` with no timeout, in a thread joined for up to `limit` s: what it raised, and when."""
    out: list[BaseException | None] = []
    t0 = time.monotonic()

    def wait() -> None:
        try:
            fut.get()  # type: ignore[attr-defined]
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(limit)
    assert out, f"a call without a timeout still waits after {limit} s"
    return out[0], time.monotonic() - t0


def test_stopped_worker_fails_pending_and_later_calls(short_timeout: None, stopped: list[int]) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="frozen")
    try:
        busy = procs.spawn("busy", Busy)
        assert busy.sleep.call(0).get(timeout=T).values() == [0, 0]
        pending = busy.sleep.call(0.2)
        os.kill(procs.pids[1], signal.SIGSTOP)
        stopped.append(procs.pids[1])
        err, elapsed = get_in_thread(pending, TIMEOUT + MARGIN)
        assert isinstance(err, SupervisionError), err
        assert err.rank == 1 and err.coords == "gpus=1" and "frozen" in str(err), err
        silent = re.search(r"no heartbeat for (\d+\.\d) s", str(err))
        assert silent and TIMEOUT <= float(silent.group(1)) < TIMEOUT + MARGIN, err
        assert "MONARCH_HEARTBEAT_TIMEOUT" in str(err) and elapsed < TIMEOUT + MARGIN, (elapsed, err)
        with pytest.raises(SupervisionError, match="no heartbeat"):
            busy.sleep.call(0).get(timeout=T)
        with pytest.raises(SupervisionError, match="no heartbeat"):
            busy.sleep.broadcast(0)
    finally:
        procs.stop()
    with this_host().spawn_procs(per_host={"gpus": 1}) as fresh:
        assert fresh.spawn("busy", Busy).sleep.call_one(0).get(timeout=T) == 0


def test_busy_workers_are_not_failed(short_timeout: None) -> None:
    """Sleeping, pure-Python and torch endpoints that run for twice the timeout all answer."""
    with this_host().spawn_procs(per_host={"x": 3}) as procs:
        busy = procs.spawn("busy", Busy)
        busy.sleep.call(0).get(timeout=T)
        seconds = 2 * TIMEOUT
        calls = [busy.slice(x=0).sleep.call_one(seconds), busy.slice(x=1).spin.call_one(seconds),
                 busy.slice(x=2).matmuls.call_one(seconds, torch.randn(256, 256))]
        results = [c.get(timeout=T) for c in calls]
        assert results[0] == seconds and results[1] > 0 and results[2] > 0, results
        assert busy.sleep.call(0).get(timeout=T).values() == [0, 0, 0]


def test_heartbeats_off_never_fail_a_stopped_worker(monkeypatch: pytest.MonkeyPatch, stopped: list[int]) -> None:
    monkeypatch.setenv("MONARCH_HEARTBEAT_TIMEOUT", "0")
    with this_host().spawn_procs(per_host={"x": 1}) as procs:
        busy = procs.spawn("busy", Busy).slice(x=0)
        busy.sleep.call_one(0).get(timeout=T)
        os.kill(procs.pids[0], signal.SIGSTOP)
        stopped.append(procs.pids[0])
        with pytest.raises(TimeoutError):
            busy.sleep.call_one(0).get(timeout=TIMEOUT + 1.0)
        os.kill(procs.pids[0], signal.SIGCONT)
        assert busy.sleep.call_one(0).get(timeout=T) == 0


def test_a_controller_that_did_not_poll_fails_no_worker(short_timeout: None) -> None:
    """Nothing polls for three timeouts (a thread holds the poll lock): what the workers sent meanwhile is
    unread when the next check runs, and that check counts silence from the resume."""
    with this_host().spawn_procs(per_host={"x": 2}) as procs:
        busy = procs.spawn("busy", Busy)
        busy.sleep.call(0).get(timeout=T)
        with controller()._poller._io:
            time.sleep(3 * TIMEOUT)
        assert busy.sleep.call(0).get(timeout=T).values() == [0, 0]


def test_a_paused_controller_fails_no_worker() -> None:
    """The controller itself stopped for three timeouts: what the workers sent meanwhile is unread, and
    no worker is failed for it."""
    script = textwrap.dedent("""
        import sys
        from monarch.actor import Actor, endpoint, this_host

        class Echo(Actor):
            @endpoint
            def ping(self, x: int) -> int:
                return x

        with this_host().spawn_procs(per_host={"x": 2}) as procs:
            echo = procs.spawn("echo", Echo)
            print(echo.ping.call(1).get(timeout=30).values(), flush=True)
            sys.stdin.readline()
            print(echo.ping.call(2).get(timeout=30).values(), flush=True)
    """)
    env = {**os.environ, "MONARCH_HEARTBEAT_TIMEOUT": "1", "PYTHONPATH": str(Path(__file__).parent)}
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "[1, 1]"
        child.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate("go\n", timeout=T)
        assert child.returncode == 0 and out.strip() == "[2, 2]", (out, err)
        assert "no heartbeat" not in err, err
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(timeout=T)
    deadline = time.monotonic() + 10
    while owned_processes(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owned_processes(child.pid), owned_processes(child.pid)


def test_a_worker_loading_torch_is_excused(short_timeout: None, stopped: list[int]) -> None:
    """Loading torch's libraries holds the GIL, so a worker sends no heartbeat meanwhile: the first tensor
    program says so (Busy), and a worker stopped for two timeouts during that import is not failed; once the
    import is done, silence counts again."""
    with this_host().spawn_procs(per_host={"x": 2}) as procs:
        conns = controller().meshes[procs._mesh.id].conns
        with procs.activate():
            pending = monarch.fetch(torch.arange(4.0) * 2)
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(pending.get(timeout=T)), daemon=True)
        waiter.start()  # the program is shipped when somebody waits for it
        deadline = time.monotonic() + T
        while not all(c is not None and c.excused_until > time.monotonic() for c in conns):
            assert time.monotonic() < deadline, "the workers never said they are loading torch"
            time.sleep(0.002)
        for pid in procs.pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        time.sleep(2 * TIMEOUT)
        for pid in procs.pids:
            os.kill(pid, signal.SIGCONT)
        waiter.join(T)
        assert got and got[0].tolist() == [0.0, 2.0, 4.0, 6.0], got  # type: ignore[attr-defined]
        assert all(c is not None and c.excused_until <= time.monotonic() for c in conns), "Busy(0) ends the excuse"
        busy = procs.spawn("busy", Busy)
        busy.sleep.call(0).get(timeout=T)
        os.kill(procs.pids[1], signal.SIGSTOP)
        with pytest.raises(SupervisionError, match="no heartbeat"):
            busy.sleep.call(0).get(timeout=T)
