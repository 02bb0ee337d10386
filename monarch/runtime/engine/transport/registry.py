"""The owner side of one-sided transfers: this process's registered regions, by slot.

Each region is kept alive (a strong reference to its tensor or memoryview) until it is dropped; a large one
is moved onto transparent huge pages when it is registered (`prefer_huge_pages`), as RDMA registration pins
memory. The slot table is a small memfd that processes of this node map read-only through
/proc/<pid>/fd/<fd> (it vanishes with this process): a process copying with cross-memory attach checks a
handle's slot there (cma.py); a writer holds a shared record lock on the slot while it copies, and `drop`
takes the exclusive lock, so it waits for the writes under way, marks the slot gone, then lets the memory go.
Transfers this process's door serves count in-process instead. Every live region is attached to each MPI
window this process owns a side of (mpi_rma.py), and detached before its memory is let go.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from monarch.errors import TransportError
from monarch.runtime.control.client import client
from monarch.runtime.engine.transport import mpi_rma, tcp, verbs
from monarch.runtime.engine.transport.handle import Handle, Owner, memory, start_time, this_node

SLOT = struct.Struct("<QQQQ16s")  # live, generation, address, size, key
HUGE_BYTES = 4 << 20  # regions from this size are backed by huge pages where the kernel can (prefer_huge_pages)
_HUGE, _MADV_HUGEPAGE, _MADV_COLLAPSE = 2 << 20, 14, 25
LIBC = ctypes.CDLL(None, use_errno=True)
SLOT_BYTES = 64
FIRST_SLOTS = 1024
DROP_WAIT_S = 30.0  # how long a drop waits for readers of another process to finish their copies


@dataclass
class Region:
    keep: object  # the tensor or memoryview whose memory this is
    addr: int
    size: int
    gen: int
    key: bytes
    rkey: int = 0


class Registry:
    """This process's registered regions and its transfer door (started with the first registration)."""

    def __init__(self) -> None:
        allow_cross_memory_readers()
        self.fd = os.memfd_create("monarch-rdma", os.MFD_CLOEXEC)
        self._slots = 0
        self._map: mmap.mmap | None = None
        self._grow(FIRST_SLOTS)
        self._regions: dict[int, Region] = {}
        self._gens: dict[int, int] = {}
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # slot -> transfers this process serves from it now
        self._idle = threading.Condition(self._lock)
        self._windows: list[mpi_rma.Attached] = []
        self.verbs = verbs.device()
        self.server = tcp.Server(self, client().reach_host())
        self.owner = Owner(os.getpid(), start_time(os.getpid()), this_node(), self.server.host, self.server.port,
                           self.fd, self.verbs.address() if self.verbs else b"", owner_label())

    def _grow(self, slots: int) -> None:
        os.ftruncate(self.fd, slots * SLOT_BYTES)
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self.fd, slots * SLOT_BYTES)
        self._slots = slots

    # -- registering and dropping ----------------------------------------------------------------
    def register(self, keep: object, addr: int, size: int) -> Handle:
        rkey = self.verbs.register(addr, size) if self.verbs else 0  # first: when it raises, no slot is taken
        prefer_huge_pages(addr, size)
        with self._lock:
            slot = self._free.pop() if self._free else len(self._gens)
            if slot >= self._slots:
                self._grow(self._slots * 2)
            gen = self._gens[slot] = self._gens.get(slot, 0) + 1
            key = secrets.token_bytes(16)
            self._regions[slot] = Region(keep, addr, size, gen, key, rkey)
            for window in self._windows:
                window.attach(addr, size)
            self._write(slot, SLOT.pack(1, gen, addr, size, key))
        return Handle(self.owner, slot, gen, key, addr, size, rkey)

    def drop(self, slot: int, gen: int, key: bytes) -> None:
        """Unregister a region once the transfers under way from it are done; later ones fail."""
        with self._lock:
            region = self._find(slot, gen, key)
            while self._busy.get(slot):
                self._idle.wait()
            self._lock_slot(slot)
            try:
                self._write(slot, SLOT.pack(0, gen, 0, 0, bytes(16)))
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT_BYTES, slot * SLOT_BYTES)
            for window in self._windows:
                window.detach(region.addr, region.size)
            del self._regions[slot]
            self._free.append(slot)
        if self.verbs and region.rkey:
            self.verbs.deregister(region.rkey)

    def _lock_slot(self, slot: int) -> None:
        """The exclusive record lock on `slot`: once readers of other processes have let go of it."""
        deadline = time.monotonic() + DROP_WAIT_S
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT_BYTES, slot * SLOT_BYTES)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TransportError(f"RDMABuffer.drop: a reader of another process held slot {slot} of "
                                         f"{self.owner} for over {DROP_WAIT_S:g} s; the buffer stays registered")
                time.sleep(0.0005)

    def _write(self, slot: int, record: bytes) -> None:
        assert self._map is not None
        self._map[slot * SLOT_BYTES:slot * SLOT_BYTES + SLOT.size] = record

    # -- what the door and this process's own transfers use ---------------------------------------
    def _find(self, slot: int, gen: int, key: bytes) -> Region:
        region = self._regions.get(slot)
        if region is None or region.gen != gen or not secrets.compare_digest(region.key, key):
            raise TransportError(f"no RDMA buffer {slot}.{gen} at {self.owner}: it was dropped, or the handle "
                                 "is not one this process registered")
        return region

    def check(self, slot: int, gen: int, key: bytes) -> None:
        """Raise TransportError unless the handle's region is registered here now (the key checked first)."""
        with self._lock:
            self._find(slot, gen, key)

    @contextmanager
    def using(self, slot: int, gen: int, key: bytes, offset: int, nbytes: int) -> Iterator[memoryview]:
        """The bytes [offset, offset + nbytes) of a live region, which is not dropped before the block ends."""
        with self._lock:
            region = self._find(slot, gen, key)
            if offset < 0 or nbytes < 0 or offset + nbytes > region.size:
                raise TransportError(f"{nbytes} bytes at offset {offset} do not fit RDMA buffer {slot}.{gen} of "
                                     f"{region.size} bytes")
            self._busy[slot] = self._busy.get(slot, 0) + 1
        try:
            yield memory(region.addr + offset, nbytes)
        finally:
            with self._lock:
                self._busy[slot] -= 1
                if not self._busy[slot]:
                    del self._busy[slot]
                    self._idle.notify_all()

    # -- MPI windows (mpi_rma.py) -------------------------------------------------------------------
    def join_mpi(self, sock: socket.socket) -> None:
        """The door's MPI_JOIN: join the asking reader's pair and serve it on `sock`."""
        mpi_rma.serve(sock, self)

    def add_window(self, window: mpi_rma.Attached) -> None:
        """Attach every live region to a new pair's window, and later ones as they are registered."""
        with self._lock:
            for region in self._regions.values():
                window.attach(region.addr, region.size)
            self._windows.append(window)

    def remove_window(self, window: mpi_rma.Attached) -> None:
        with self._lock:
            self._windows.remove(window)
            window.detach_all()

    def live(self) -> int:
        """How many regions are registered now."""
        return len(self._regions)


_registry: list[Registry] = []
_made = threading.Lock()


def registry() -> Registry:
    """This process's registry, made (with its door) on first use."""
    if not _registry:
        with _made:
            if not _registry:
                _registry.append(Registry())
    return _registry[0]


def registered() -> Registry | None:
    """This process's registry if one was made (a handle of this process is served without a copy)."""
    return _registry[0] if _registry else None


def owner_label() -> str:
    """How errors name this process: its rank and mesh on a worker, "the controller" there."""
    c = client()
    if c.is_controller:
        return f"the controller (pid {os.getpid()})"
    mesh, rank = c.port_owner() or (0, 0)
    return f"rank {rank} of mesh #{mesh} (pid {os.getpid()})"


def allow_cross_memory_readers() -> None:
    """Let processes of this user read this one with process_vm_readv where Yama restricts ptrace to
    descendants (prctl PR_SET_PTRACER_ANY; a no-op without Yama)."""
    with contextlib.suppress(AttributeError):  # no libc prctl: nothing restricts attaching either
        LIBC.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)


def prefer_huge_pages(addr: int, size: int) -> None:
    """Back the whole 2 MiB pages inside [addr, addr + size) of this process by transparent huge pages now
    (madvise MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1+), when the region has HUGE_BYTES or more: cross-memory
    attach then pins one page where it pinned 512, which about doubles its bandwidth. The data stay as they
    are; a kernel without THP or collapse says no, and nothing changes."""
    lo, hi = -(-addr // _HUGE) * _HUGE, (addr + size) // _HUGE * _HUGE
    if size < HUGE_BYTES or hi <= lo:
        return
    for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
        if LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice) != 0:
            return
