"""Failures: kill -9 mid-call, __supervise__, stop and exit clean-up, spawn errors, controller death."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import owned_processes, run_script

from monarch.actor import Actor, MeshFailure, endpoint, this_host
from monarch.errors import SpawnError, SupervisionError

T = 30
ROOT = Path(__file__).resolve().parents[3]
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


def run_client(body: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` (dedented) as a client process with Monarch's default unhandled_fault_hook."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(body), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done, time.monotonic() - t0


ACTORS = """
    import os, signal, sys, time
    from monarch.actor import Actor, endpoint, this_host
    from monarch.errors import SupervisionError

    class Worker(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

        @endpoint
        def sleep(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

        @endpoint
        def fail(self) -> None:
            raise ValueError("unhandled on purpose")
"""


def test_a_pending_call_raises_the_fault_and_catching_it_keeps_the_client() -> None:
    """A worker killed under a pending get(): the get raises SupervisionError; the program catches it, so
    the fault was delivered and the client goes on (later calls on the mesh still raise)."""
    done, _ = run_client(ACTORS + """
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    workers = procs.spawn("workers", Worker)
    pids = workers.pid.call().get(timeout=30).values()
    pending = workers.sleep.call(60)
    os.kill(pids[1], signal.SIGKILL)
    try:
        pending.get(timeout=30)
    except SupervisionError as e:
        print("caught rank", e.rank, flush=True)
    time.sleep(1)
    try:
        workers.pid.call().get(timeout=30)
    except SupervisionError:
        print("still failed", flush=True)
    fresh = this_host().spawn_procs(per_host={"gpus": 1})
    print("fresh", fresh.spawn("w", Worker).sleep.call_one(0).get(timeout=30), flush=True)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["caught rank 1", "still failed", "fresh 0"], done.stdout
    assert "Unhandled monarch error" not in done.stderr, done.stderr[-3000:]


def test_an_unhandled_fault_ends_the_client_once_it_is_out_of_monarch_code() -> None:
    """The fault arrives while the main thread waits in a call on another mesh: that call returns its value,
    then the client exits (status 1) at the next user statement, with one report for both failed ranks."""
    done, _ = run_client(ACTORS + """
    victims = this_host().spawn_procs(per_host={"gpus": 2}, name="victims")
    sleeper = this_host().spawn_procs(per_host={"gpus": 1}).spawn("sleeper", Worker)
    victims.spawn("bad", Worker).fail.broadcast()
    print("got", sleeper.sleep.call_one(2).get(timeout=30), flush=True)
    time.sleep(20)
    print("survived", flush=True)
    """)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "got 2" in done.stdout and "survived" not in done.stdout, done.stdout
    assert done.stderr.count("Unhandled monarch error") == 1, done.stderr[-3000:]
    assert "unhandled on purpose" in done.stderr and "The program exits with status 1" in done.stderr


IPYTHON = ACTORS + """
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    cells = ['procs = this_host().spawn_procs(per_host={"gpus": 1})',
             'procs.spawn("bad", Worker).fail.broadcast()\\ntime.sleep(20)\\nprint("cell 2 finished")',
             'print("alive", procs.spawn("good", Worker).sleep.call_one(0).get(timeout=30))']
    shell.user_ns.update(Worker=Worker, this_host=this_host, time=time)
    for cell in cells:
        result = shell.run_cell(cell)
        print("cell:", type(result.error_in_exec).__name__, flush=True)
"""


def test_in_ipython_an_unhandled_fault_interrupts_the_cell_and_the_kernel_lives() -> None:
    done, _ = run_client(IPYTHON)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.split("\n") if ln.startswith(("cell", "alive"))]
    assert lines == ["cell: NoneType", "cell: KeyboardInterrupt", "alive 0", "cell: NoneType"], done.stdout
    assert done.stderr.count("Unhandled monarch error") == 1 and "The cell was interrupted" in done.stderr
    assert "exits" not in done.stderr, done.stderr[-3000:]


def test_the_next_call_of_a_failed_actor_mesh_raises_the_fault_first() -> None:
    """The fault arrives while the main thread waits on another mesh; the program's next call is on the
    failed actors: it raises SupervisionError with the report, the program catches it, the client goes on."""
    done, _ = run_client(ACTORS + """
    bad = this_host().spawn_procs(per_host={"gpus": 2}, name="victims").spawn("bad", Worker)
    sleeper = this_host().spawn_procs(per_host={"gpus": 1}).spawn("sleeper", Worker)
    bad.fail.broadcast()
    got = sleeper.sleep.call_one(2).get(timeout=30)
    try:
        bad.pid.call().get(timeout=30)
    except SupervisionError as e:
        caught = "unhandled on purpose" in str(e)
    print("got", got, "caught", caught, flush=True)
    time.sleep(1)
    print("survived", flush=True)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["got 2 caught True", "survived"], done.stdout
    assert "Unhandled monarch error" not in done.stderr, done.stderr[-3000:]
