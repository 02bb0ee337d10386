"""Nothing of a mesh remains after it ends, however it ends: kill -9 of a worker, of its monitor or of
mpiexec, or a stop while every worker is busy. MPICH's shared-memory segments lose their names as soon as
every rank attached (so no /dev/shm/mpich_shm_* outlives the job), the hydra proxies' topology files
(/tmp/hydra_hwloc_xmlfile_*) the job added are removed when it ends, and the controller closes the job's
pipes (its open file descriptors are back where they were). MPICH's "BAD TERMINATION" banner, which
mpiexec prints when a job ends by a signal, never reaches the terminal (monarch reports the failure).
"""
from __future__ import annotations

import gc
import glob
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from monarch.actor import Actor, ProcMesh, endpoint, this_host

T = 30.0
pytestmark = pytest.mark.slow


class Busy(Actor):
    @endpoint
    def pids(self) -> tuple[int, int]:
        return os.getpid(), os.getppid()

    @endpoint
    def work(self) -> None:
        time.sleep(60)


def files() -> set[str]:
    return set(glob.glob("/dev/shm/mpich_shm_*")) | set(glob.glob("/tmp/hydra_hwloc_xmlfile_*"))


def fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


ENDS: dict[str, Callable[[ProcMesh, tuple[int, int]], None]] = {
    "worker": lambda procs, pids: kill(pids[0]),
    "monitor": lambda procs, pids: kill(pids[1]),
    "mpiexec": lambda procs, pids: kill(procs._mesh.proc.pid),
    "busy-stop": lambda procs, pids: None,
}


@pytest.mark.parametrize("end", list(ENDS))
def test_nothing_of_a_mesh_remains(end: str, faults: list, capfd: pytest.CaptureFixture[str]) -> None:
    this_host().spawn_procs(per_host={"gpus": 1}).stop().get(timeout=T)  # the controller's own sockets exist
    gc.collect()
    before, open_before = files(), fds()
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    busy = procs.spawn("busy", Busy)
    every = busy.pids.call().get(timeout=T).values()
    pids = every[0]
    added = files() - before
    assert procs._mesh.leftovers and procs._mesh.leftovers <= added  # the controller noted its job's files
    added &= procs._mesh.leftovers  # not those of meshes other processes started meanwhile
    for worker, _ in every:  # the segments every rank maps have no name any more
        maps = Path(f"/proc/{worker}/maps").read_text().splitlines()
        assert not [m for m in maps if "/dev/shm/mpich_shm_" in m and not m.endswith("(deleted)")], maps
    busy.work.broadcast()
    ENDS[end](procs, pids)
    if end != "busy-stop":
        deadline = time.monotonic() + T
        while not faults and time.monotonic() < deadline:
            time.sleep(0.05)
        assert faults, f"kill -9 of the {end} was not noticed"
    procs.stop().get(timeout=T)
    del procs, busy
    gc.collect()
    assert not [f for f in added if Path(f).exists()], added
    assert fds() == open_before, sorted(os.listdir(f"/proc/{os.getpid()}/fd"))
    shown = capfd.readouterr()
    assert "BAD TERMINATION" not in shown.out + shown.err, "MPICH's banner reached the terminal"
