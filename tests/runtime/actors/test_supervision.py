"""Failures: kill -9 mid-call, __supervise__, stop and exit clean-up, spawn errors, controller death."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from processes import owned_processes, run_script

from monarch.actor import Actor, MeshFailure, endpoint, this_host
from monarch.errors import SpawnError, SupervisionError

T = 30
pytestmark = pytest.mark.slow  # each test starts its own meshes; `pytest -m "not slow"` skips them


class Sleeper(Actor):
    def __init__(self) -> None:
        self.failures: list[MeshFailure] = []

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def seen(self) -> list[str]:
        return [f.message() for f in self.failures]

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(failure)
        return True


def test_kill_9_fails_pending_and_later_calls_quickly(faults: list[MeshFailure]) -> None:
    """Also: the supervision event goes to the mesh's owner, here the client (its unhandled_fault_hook,
    which the test suite records); actors of other meshes are not told."""
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="victim")
    watcher_procs = this_host().spawn_procs(per_host={"gpus": 1}, name="watcher")
    try:
        sleepers = procs.spawn("sleepers", Sleeper)
        watcher = watcher_procs.spawn("watcher", Sleeper)
        pids = sleepers.pid.call().get(timeout=T).values()
        assert pids == procs.pids
        pending = sleepers.sleep.call(60)
        time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SupervisionError) as info:
            pending.get(timeout=T)
        elapsed = time.monotonic() - t0
        assert elapsed < 5, elapsed
        e = info.value
        assert e.rank == 1 and e.coords == "gpus=1" and "signal 9 (SIGKILL)" in str(e) and "victim" in str(e)
        with pytest.raises(SupervisionError, match="signal 9"):
            sleepers.pid.call().get(timeout=1)
        deadline = time.monotonic() + T
        while not faults and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(faults) == 1 and "rank 1 (gpus=1)" in faults[0].message() and faults[0].mesh_name == "victim"
        assert watcher.seen.call_one().get(timeout=T) == []
    finally:
        procs.stop()
        watcher_procs.stop()
    with this_host().spawn_procs(per_host={"gpus": 2}) as fresh:
        assert fresh.spawn("s", Sleeper).sleep.call(0).get(timeout=T).values() == [0, 0]


def test_stop_and_context_exit_end_every_process() -> None:
    with this_host().spawn_procs(per_host={"dp": 2}) as procs:
        s = procs.spawn("s", Sleeper)
        s.pid.call().get(timeout=T)
        assert len(owned_processes(os.getpid())) >= 5  # mpiexec, 2 monitors, 2 workers
        pending = s.sleep.call(0.5)
    with pytest.raises(SupervisionError, match="stopped"):
        s.pid.call().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        s.pid.broadcast()
    assert pending.done()
    procs.stop()  # idempotent


def test_missing_mpiexec_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_MPIEXEC", "/nonexistent/mpiexec")
    with pytest.raises(SpawnError, match="mpiexec not found at /nonexistent/mpiexec"):
        this_host().spawn_procs(per_host={"gpus": 1})


def test_worker_crash_on_import_reports_stderr(tmp_path: Path) -> None:
    broken = tmp_path / "mpi4py"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("simulated broken mpi4py install")\n')
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        this_host().spawn_procs(per_host={"gpus": 2}, env={"PYTHONPATH": str(tmp_path)})
    assert time.monotonic() - t0 < 20
    assert "simulated broken mpi4py install" in str(info.value) and "exited with code 1" in str(info.value)


def test_interpreter_exit_stops_workers() -> None:
    child = run_script("""
        from monarch.actor import this_host
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        print(procs.pids, flush=True)
    """)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip()
    deadline = time.monotonic() + 10
    while owned_processes(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owned_processes(child.pid)


def test_workers_exit_when_the_controller_is_killed() -> None:
    child = run_script("""
        import time
        from monarch.actor import this_host
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        print("up", flush=True)
        time.sleep(60)
    """)
    kill_when_up_and_expect_no_workers(child, within=10)


def test_busy_workers_die_with_a_killed_controller() -> None:
    """Workers in the middle of long work do not finish it first: their monitors see the controller go."""
    child = run_script("""
        import time
        from monarch.actor import Actor, endpoint, this_host

        class Busy(Actor):
            @endpoint
            def work(self) -> None:
                time.sleep(60)

        procs = this_host().spawn_procs(per_host={"gpus": 2})
        procs.spawn("busy", Busy).work.broadcast()
        print("up", flush=True)
        time.sleep(60)
    """)
    kill_when_up_and_expect_no_workers(child, within=5)


def kill_when_up_and_expect_no_workers(child: subprocess.Popen, within: float) -> None:
    """SIGKILL a controller script once it printed "up"; its workers must be gone `within` seconds."""
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        time.sleep(0.5)
        assert owned_processes(child.pid)
    finally:
        child.kill()
        child.wait(timeout=T)
    deadline = time.monotonic() + within
    while owned_processes(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owned_processes(child.pid), owned_processes(child.pid)
