"""RDMABuffer over MPI RMA windows (MONARCH_RDMA_BACKEND=mpi in the readers' environment) between real meshes:
values of reads and writes within one mesh and across two MPI jobs, a read while the owner's actor is busy,
a dropped buffer, a killed owner, a controller end, and auto never picking it on one host.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from rdma_actors import T, Owner, Reader, backend

from monarch.actor import ActorMesh, ProcMesh, endpoint, this_host
from monarch.errors import TransportError
from monarch.rdma import RDMABuffer
from monarch.runtime.engine.transport.handle import start_time

pytestmark = pytest.mark.slow
MPI_ENV = {"MONARCH_RDMA_BACKEND": "mpi"}


class BusyOwner(Owner):
    """An owner whose endpoint can keep its actor (and its process's main thread) busy."""

    @endpoint
    def busy(self, seconds: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(0.05)  # no MPI call: only the door's thread can drive progress
        return time.monotonic()


class TimedReader(Reader):
    @endpoint
    def timed_read(self, buf: RDMABuffer) -> tuple[torch.Tensor, float]:
        dst = torch.empty(buf.size(), dtype=torch.uint8)
        buf.read_into(dst).get(timeout=T)
        return dst, time.monotonic()


@pytest.fixture(scope="module")
def near() -> Iterator[ProcMesh]:
    """Two ranks of one MPI job: rank 0 owns, rank 1 reads."""
    with this_host().spawn_procs(per_host={"gpus": 2}, name="mpi_rma_near", env=MPI_ENV) as procs:
        yield procs


@pytest.fixture(scope="module")
def far() -> Iterator[ActorMesh[TimedReader]]:
    """A reader in another MPI job."""
    with this_host().spawn_procs(per_host={"gpus": 1}, name="mpi_rma_far", env=MPI_ENV) as procs:
        yield procs.spawn("far", TimedReader)


@pytest.fixture(scope="module")
def owners(near: ProcMesh) -> ActorMesh[BusyOwner]:
    return near.spawn("owner", BusyOwner)


@pytest.fixture(scope="module")
def readers(near: ProcMesh) -> ActorMesh[TimedReader]:
    return near.spawn("reader", TimedReader)


def share(owner: ActorMesh[BusyOwner], name: str, data: torch.Tensor) -> RDMABuffer:
    return owner.share.call_one(name, data).get(timeout=T)


@pytest.mark.parametrize("size", [8, 4096 + 3, 3 << 20])
def test_reads_and_writes_within_a_mesh_and_across_two_jobs(
        owners: ActorMesh[BusyOwner], readers: ActorMesh[TimedReader], far: ActorMesh[TimedReader], size: int) -> None:
    owner = owners.slice(gpus=0)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    buf = share(owner, f"rw{size}", data)
    for reader in (readers.slice(gpus=1), far):
        got, via = reader.read.call_one(buf, "mpi").get(timeout=T)
        assert via == "mpi" and torch.equal(got, data)
        offset = size // 3
        got, _ = reader.read.call_one(buf, "mpi", offset).get(timeout=T)
        assert torch.equal(got, data[offset:])
        patch = torch.randint(0, 256, (size - offset,), dtype=torch.uint8)
        assert reader.write.call_one(buf, "mpi", patch, offset).get(timeout=T) == "mpi"
        data[offset:] = patch
        assert torch.equal(owner.value.call_one(f"rw{size}").get(timeout=T), data)
    floats = torch.randn(1000)
    buf = share(owner, f"f{size}", floats)
    got, _ = far.read.call_one(buf, "mpi", 0, floats).get(timeout=T)
    assert torch.equal(got, floats)


def test_a_read_completes_while_the_owner_is_busy(owners: ActorMesh[BusyOwner], far: ActorMesh[TimedReader]) -> None:
    owner = owners.slice(gpus=1)  # no pair joined with it yet: the join runs while it is busy too
    data = torch.arange(1 << 18, dtype=torch.int32)
    buf = share(owner, "busy", data)
    busy = owner.busy.call_one(8.0)
    time.sleep(1.0)  # the endpoint is running
    got, read_at = far.timed_read.call_one(buf).get(timeout=T)
    assert torch.equal(got.view(torch.int32), data)
    assert read_at < busy.get(timeout=T), "the read waited for the owner's endpoint"


def test_a_dropped_buffer_fails_the_read(owners: ActorMesh[BusyOwner], far: ActorMesh[TimedReader]) -> None:
    owner = owners.slice(gpus=0)
    buf = share(owner, "dropped", torch.ones(4096, dtype=torch.uint8))
    assert far.try_read.call_one(buf, "mpi").get(timeout=T)[0] == ""
    owner.drop.call_one(buf).get(timeout=T)
    error, _ = far.try_read.call_one(buf, "mpi").get(timeout=T)
    assert error.startswith("TransportError") and "it was dropped" in error, error
    fresh = share(owner, "fresh", torch.full((100,), 7, dtype=torch.uint8))  # the pair still serves
    got, _ = far.read.call_one(fresh, "mpi").get(timeout=T)
    assert torch.equal(got, torch.full((100,), 7, dtype=torch.uint8))


def test_the_controller_is_no_end_of_an_mpi_transfer(owners: ActorMesh[BusyOwner],
                                                     far: ActorMesh[TimedReader]) -> None:
    buf = share(owners.slice(gpus=0), "ctl", torch.ones(64, dtype=torch.uint8))
    with backend("mpi"), pytest.raises(TransportError, match="MONARCH_RDMA_BACKEND=mpi, but this process"):
        buf.read_into(torch.empty(64, dtype=torch.uint8)).get(timeout=T)
    mine = RDMABuffer(torch.ones(64, dtype=torch.uint8))
    error, _ = far.try_read.call_one(mine, "mpi").get(timeout=T)
    assert "the buffer's owner, the controller" in error and "unset it" in error, error


def test_auto_keeps_shm_on_one_host(owners: ActorMesh[BusyOwner], far: ActorMesh[TimedReader]) -> None:
    buf = share(owners.slice(gpus=0), "auto", torch.ones(64, dtype=torch.uint8))
    assert far.read.call_one(buf, "auto").get(timeout=T)[1] == "shm"


def test_a_hung_or_killed_owner_fails_within_the_timeout(far: ActorMesh[TimedReader], faults: list) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="mpi_rma_victim")
    try:
        victim = procs.spawn("victim", BusyOwner)
        buf = share(victim, "doomed", torch.ones(1 << 16, dtype=torch.uint8))
        assert far.try_read.call_one(buf, "mpi").get(timeout=T)[0] == ""  # the pair is joined
        pid = victim.pid.call_one().get(timeout=T)
        os.kill(pid, signal.SIGSTOP)  # hung: the reader gives up at its timeout, and abandons the pair
        try:
            error, took = far.try_read.call_one(buf, "mpi", 1.0).get(timeout=T)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "did not answer on the pair's line" in error and buf.owner in error, error
        assert 0.9 < took < 2.0, took
        started = start_time(pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + T
        while start_time(pid) == started and time.monotonic() < deadline:
            time.sleep(0.01)
        error, took = far.try_read.call_one(buf, "mpi", 2.0).get(timeout=T)
        assert error.startswith("TransportError") and buf.owner in error, error
        assert took < 2.5, took
    finally:
        procs.stop()
