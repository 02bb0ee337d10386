"""One-sided transfers, whichever way reaches the owner: the backend choice, and the reads and writes
that monarch.rdma's RDMABuffer and the tensor engine's `to_mesh` pieces run.

The choice, per owner (MONARCH_RDMA_BACKEND forces one): the same process copies in place; `shm`
(cross-memory attach) between processes of one node; `ibverbs` where both ends have an RDMA port of one
kind (InfiniBand or RoCE); `mpi` (RMA windows) from a worker whose UCX has an RDMA transport to a worker
of another node; `tcp` through the owner's door otherwise, with a warning the first time
(MONARCH_RDMA_ALLOW_TCP_FALLBACK=0 makes it an error instead). Transfers run in the calling thread; the
caller keeps its memory alive meanwhile.
"""
from __future__ import annotations

import ctypes
import warnings

import torch

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.engine.transport import cma, mpi_rma, tcp, verbs
from monarch.runtime.engine.transport.handle import Handle, region
from monarch.runtime.engine.transport.registry import registered, registry


class RDMAReadTransferWarning(Warning):
    """A read went over TCP: no RDMA device reaches the buffer's owner (printed once per process)."""


class RDMAWriteTransferWarning(Warning):
    """A write went over TCP: no RDMA device reaches the buffer's owner (printed once per process)."""


_warned: set[type[Warning]] = set()  # a filter's "once" is forgotten whenever warning filters change
_no_attach: set[int] = set()  # owner pids this kernel refused cross-memory attach to
_no_mpi: set[tuple[int, int]] = set()  # owners (pid, start time) whose door refused an MPI pair


def register(data: torch.Tensor | memoryview, what: str = "RDMABuffer") -> Handle:
    """Register `data`'s memory in this process (no copy); it stays registered until dropped."""
    addr, size = region(data, what)
    if size == 0:
        raise ValueError(f"{what}: cannot register an empty buffer (0 bytes)")
    return registry().register(data, addr, size)


def drop(handle: Handle, timeout: float) -> None:
    """Unregister the region: here when this process owns it, else through the owner's door."""
    mine = registered()
    if mine is not None and handle.owner == mine.owner:
        mine.drop(handle.slot, handle.gen, handle.key)
    else:
        tcp.drop(handle, timeout)


def backend_for(handle: Handle) -> str:
    """The backend a transfer from this process to the handle's owner takes: local, shm, ibverbs, mpi or tcp."""
    mine = registered()
    if mine is not None and handle.owner == mine.owner:
        return "local"
    forced = config.rdma_backend()
    if forced != "auto":
        return forced
    if cma.reaches(handle.owner) and handle.owner.pid not in _no_attach:
        return "shm"  # one host: a copy between the processes beats a loop through the NIC
    device = verbs.device()
    if handle.rkey and device is not None and device.reaches(handle.owner.verbs):
        return "ibverbs"
    if mpi_rma.offers_rdma() and (handle.owner.pid, handle.owner.started) not in _no_mpi:
        return "mpi"  # a worker with RDMA under UCX; the owner's door says whether it is one too
    return "tcp"


def network_backend() -> str:
    """What carries transfers between hosts from this process: ibverbs with an RDMA device, else tcp (none
    when the TCP fallback is turned off)."""
    if verbs.device() is not None:
        return "ibverbs"
    return "tcp" if config.rdma_allow_tcp_fallback() else "none"


def read(handle: Handle, offset: int, addr: int, n: int, timeout: float) -> None:
    """Copy the region's `n` bytes from `offset` to this process's address `addr` (memory the caller keeps)."""
    handle.check(offset, n, "read_into")
    _move(handle, offset, addr, n, timeout, True)


def write(handle: Handle, offset: int, addr: int, n: int, timeout: float) -> None:
    """Copy `n` bytes at this process's address `addr` into the region from `offset`."""
    handle.check(offset, n, "write_from")
    _move(handle, offset, addr, n, timeout, False)


def _move(handle: Handle, offset: int, addr: int, n: int, timeout: float, reading: bool) -> None:
    if n == 0:
        return
    backend = backend_for(handle)
    if backend == "local":
        with registry().using(handle.slot, handle.gen, handle.key, offset, n) as there:
            ctypes.memmove(addr, _address(there), n) if reading else ctypes.memmove(_address(there), addr, n)
        return
    if backend == "shm":
        try:
            (cma.read if reading else cma.write)(handle, offset, n, addr)
            return
        except cma.Refused:
            _no_attach.add(handle.owner.pid)
            if config.rdma_backend() == "shm":
                raise TransportError(f"MONARCH_RDMA_BACKEND=shm, but this kernel refuses cross-memory attach to "
                                     f"{handle.owner} (ptrace restrictions); unset it to use TCP") from None
    mem = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")  # what the other backends move
    if backend == "ibverbs":
        device = verbs.device()
        if device is None:
            raise TransportError(f"MONARCH_RDMA_BACKEND=ibverbs, but {verbs.why_not()}")
        (device.read if reading else device.write)(handle, offset, mem, addr, timeout)
        return
    if backend == "mpi":
        try:
            (mpi_rma.read if reading else mpi_rma.write)(handle, offset, mem, addr, timeout)
            return
        except mpi_rma.NotMPI as e:
            if config.rdma_backend() == "mpi":
                raise TransportError(f"MONARCH_RDMA_BACKEND=mpi, but {e}; unset it (or set it to tcp) for a "
                                     "transfer with a process outside MPI") from None
            _no_mpi.add((handle.owner.pid, handle.owner.started))
    _tcp(handle, offset, mem, timeout, reading)


def _tcp(handle: Handle, offset: int, mem: memoryview, timeout: float, reading: bool) -> None:
    if config.rdma_backend() == "auto":
        if not config.rdma_allow_tcp_fallback():
            raise TransportError(f"no RDMA path reaches {handle.owner} ({verbs.why_not() or 'its device differs'})"
                                 " and MONARCH_RDMA_ALLOW_TCP_FALLBACK=0; allow the TCP fallback or run on hosts "
                                 "with RDMA devices")
        category = RDMAReadTransferWarning if reading else RDMAWriteTransferWarning
        if category not in _warned:
            _warned.add(category)
            warnings.warn(f"RDMA {'read' if reading else 'write'} with {handle.owner} goes over TCP "
                          f"({verbs.why_not() or 'no RDMA path to that host'}); expect a few GB/s",
                          category, stacklevel=4)
    (tcp.read if reading else tcp.write)(handle, offset, mem, timeout)


def _address(mem: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))
