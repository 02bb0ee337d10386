"""Shared fixtures: a module-wide 2x2 proc mesh and the check that no test leaves a process behind.

Worker processes carry `--owner <controller pid>` on their command line; after every test, any such
process (mpiexec, monitor or worker) that does not belong to a mesh still open in the controller fails it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import owned_processes

from monarch.actor import MeshFailure, ProcMesh, this_host
from monarch.runtime.control.controller import controller


def _open_mesh_pids() -> set[int]:
    """Processes of meshes still open: mpiexec, workers and their monitors (the workers' parents)."""
    pids: set[int] = set()
    for mesh in list(controller().meshes.values()) if _controller_started() else []:
        if mesh.proc is not None:
            pids.add(mesh.proc.pid)
        for pid in mesh.pids:
            pids.add(pid)
            try:
                pids.add(int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def _controller_started() -> bool:
    from monarch.runtime.control import controller as ctl
    return ctl._controller is not None


def leftovers(owner: int, allowed: set[int], timeout: float = 10.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        left = {p: c for p, c in owned_processes(owner).items() if p not in allowed}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


DATAPLANE = ("rdma", "runtime/engine", "runtime/session/test_to_mesh.py", "end_to_end/test_mesh_to_mesh_examples.py")
OPINFO = ("graph/test_opinfo.py",)  # the OpInfo sweep: every sample of every claimed op on a real mesh
ON_PROCS = ("test_api_procs", "test_parallel_procs", "test_meta_procs", "test_meta_example", "test_dtensor_programs")
END_TO_END = ("end_to_end", *(f"dtensor/{name}.py" for name in ON_PROCS))  # models, examples, DTensor programs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that starts worker processes: it uses a mesh fixture, or its module spawns; and
    `dataplane` the tests of the data plane (their own tier, `make test-dataplane`), `opinfo` the OpInfo sweep
    (`make test-opinfo`), `end_to_end` the end-to-end training runs and DTensor programs on real meshes
    (`make test-e2e`; the data-plane examples stay in theirs)."""
    spawns: dict[Path, bool] = {}
    tests = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.fspath))
        where = path.resolve().relative_to(tests).as_posix()
        if where.startswith(DATAPLANE):
            item.add_marker(pytest.mark.dataplane)
        if where.startswith(OPINFO):
            item.add_marker(pytest.mark.opinfo)
        if where.startswith(END_TO_END) and not where.startswith(DATAPLANE):
            item.add_marker(pytest.mark.end_to_end)
        if path not in spawns:
            spawns[path] = "spawn_procs(" in path.read_text()
        if spawns[path] or "procs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    yield
    left = leftovers(os.getpid(), _open_mesh_pids())
    assert not left, f"processes left behind by this test: {left}"


FAULTS: list[MeshFailure] = []  # supervision events that reached the client in this test session


def _record_fault(failure: MeshFailure) -> None:
    """The test suite's unhandled_fault_hook: record the event and keep the client (pytest) running.
    Monarch's default (exit the client with status 1) is tested in a subprocess."""
    FAULTS.append(failure)


@pytest.fixture(autouse=True, scope="session")
def recorded_faults() -> Iterator[list[MeshFailure]]:
    import monarch.actor
    default, monarch.actor.unhandled_fault_hook = monarch.actor.unhandled_fault_hook, _record_fault
    yield FAULTS
    monarch.actor.unhandled_fault_hook = default


@pytest.fixture
def faults() -> list[MeshFailure]:
    """The supervision events that reach the client during this test (cleared first)."""
    FAULTS.clear()
    return FAULTS


@pytest.fixture(scope="module")
def procs() -> Iterator[ProcMesh]:
    """A 4-process dp=2 x tp=2 mesh shared by the tests of one module."""
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as p:
        yield p


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """MONARCH_STRICT=1: an op without a sharding rule fails instead of running replicated."""
    monkeypatch.setenv("MONARCH_STRICT", "1")
