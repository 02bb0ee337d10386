"""Same-node transfers by cross-memory attach: one copy, straight between the two processes' memory, and the
owner runs nothing for it. Small reads go through the owner's /proc/<pid>/mem (one pread, no page pinning:
half the cost of process_vm_readv for a few bytes); the rest by process_vm_readv / process_vm_writev,
split among a few threads from SPLIT_BYTES on (as a NIC's engines copy in parallel), with both sides on huge pages
where the kernel allows (the owner's at registration, this side's on its first large copy).

The handle is checked in the owner's slot table (registry.py), mapped read-only through /proc/<pid>/fd/<fd>:
a read checks it before and after its copy (a drop in between fails the read); a write holds a shared record
lock on the slot for its copy, so a drop waits for it. A kernel that refuses the attach
(EPERM: ptrace restrictions) raises `Refused`, and the caller goes through the owner's door instead.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from monarch.errors import TransportError
from monarch.runtime.engine.transport.handle import Handle, Owner, memory, start_time, this_node
from monarch.runtime.engine.transport.registry import HUGE_BYTES, LIBC, SLOT, SLOT_BYTES, prefer_huge_pages

SMALL_BYTES = 32 << 10  # up to this, a copy is one pread/pwrite of /proc/<pid>/mem
SPLIT_BYTES = 16 << 20  # from this, a copy is split among up to COPY_THREADS threads
COPY_THREADS = 4


class Refused(Exception):
    """This kernel does not let this process attach to the owner's memory."""


class _iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_CALLS = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(LIBC, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_iovec), ctypes.c_ulong, ctypes.POINTER(_iovec), ctypes.c_ulong,
                    ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t
    _CALLS[_name] = _fn


class Table:
    """Another process's slot table, mapped read-only, and the slots this process holds locked now (a
    record lock belongs to the process, so threads of it share each slot's lock by count)."""

    def __init__(self, owner: Owner) -> None:
        path = f"/proc/{owner.pid}/fd/{owner.table_fd}"
        try:
            if not os.readlink(path).startswith("/memfd:monarch-rdma"):
                raise TransportError(f"RDMA handle of {owner}: fd {owner.table_fd} of pid {owner.pid} is not a "
                                     "monarch slot table (a forged handle, or the pid was reused)")
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            raise Refused() from None
        except FileNotFoundError:
            _check_alive(owner)
            raise TransportError(f"RDMA handle of {owner}: fd {owner.table_fd} of pid {owner.pid} is not a monarch "
                                 "slot table (a forged handle)") from None
        self.owner = owner
        self.mem = _open_mem(owner.pid)
        self._map: mmap.mmap | None = None
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def record(self, slot: int) -> bytes:
        """The slot's record as the owner wrote it (zeros past the table's end)."""
        start = slot * SLOT_BYTES
        if self._map is None or len(self._map) < start + SLOT_BYTES:
            size = os.fstat(self.fd).st_size
            if size < start + SLOT_BYTES:
                return bytes(SLOT.size)
            self._map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ)
        return self._map[start:start + SLOT.size]

    @contextmanager
    def holding(self, slot: int) -> Iterator[None]:
        with self._lock:
            n = self._held.get(slot, 0)
            if not n:
                fcntl.lockf(self.fd, fcntl.LOCK_SH, SLOT_BYTES, slot * SLOT_BYTES)
            self._held[slot] = n + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[slot] -= 1
                if not self._held[slot]:
                    del self._held[slot]
                    fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT_BYTES, slot * SLOT_BYTES)


_tables: dict[tuple[int, int, int], Table] = {}  # by pid, start time and table fd: each handle's fd is checked
_tables_lock = threading.Lock()


def reaches(owner: Owner) -> bool:
    """Whether the owner runs on this node (same kernel and pid namespace) in another process."""
    return owner.node == this_node() and owner.pid != os.getpid()


def read(handle: Handle, offset: int, n: int, addr: int) -> None:
    """Copy the owner's bytes [offset, offset + n) to this process's address `addr`."""
    _copy(True, handle, offset, n, addr)


def write(handle: Handle, offset: int, n: int, addr: int) -> None:
    """Copy n bytes from this process's address `addr` to the owner's bytes at `offset`."""
    _copy(False, handle, offset, n, addr)


def read_memory(pid: int, remote: int, local: int, n: int) -> None:
    """Copy n bytes at address `remote` of process `pid` to this process's address `local`, with no slot table:
    the caller knows the memory is alive. `Refused` where the kernel forbids the attach, OSError otherwise."""
    err = _vm(True, pid, local, remote, n)
    if err == errno.EPERM:
        raise Refused()
    if err:
        raise OSError(err, os.strerror(err))


def _copy(reading: bool, handle: Handle, offset: int, n: int, local: int) -> None:
    """A read checks the slot before and after its copy (a drop in between, which may have freed the memory,
    fails it: never stale bytes) and takes no lock; a write holds the slot's shared lock, so the region cannot
    be dropped and its memory reused while the bytes land."""
    table = _table(handle.owner)
    expected = SLOT.pack(1, handle.gen, handle.addr, handle.size, handle.key)
    if reading:
        _check_slot(table, handle, expected)
        _attach(reading, handle, offset, n, local, table, expected)
        _check_slot(table, handle, expected)
        return
    with table.holding(handle.slot):
        _check_slot(table, handle, expected)
        _attach(reading, handle, offset, n, local, table, expected)


def _check_slot(table: Table, handle: Handle, expected: bytes) -> None:
    """The slot must hold the handle's record (a plain comparison: a process that can map the table reads its
    keys anyway, so the key is no secret from it)."""
    if table.record(handle.slot) != expected:
        _check_alive(handle.owner)
        raise TransportError(f"no RDMA buffer {handle.slot}.{handle.gen} at {handle.owner}: it was dropped, or "
                             "the handle is not one that process registered")


def _attach(reading: bool, handle: Handle, offset: int, n: int, local: int, table: Table, expected: bytes) -> None:
    err = _moved(reading, table, handle.addr + offset, local, n)
    if err:
        if err == errno.EPERM:
            raise Refused()
        _check_alive(handle.owner)
        _check_slot(table, handle, expected)  # dropped meanwhile
        raise TransportError(f"RDMA transfer with {handle.owner} failed: {os.strerror(err)}")


def _moved(reading: bool, table: Table, remote: int, local: int, n: int) -> int:
    """Copy n bytes between the owner's `remote` and this process's `local`: 0, or the errno of a failure. Only
    reads go through /proc/<pid>/mem: a write there would also land in memory the owner mapped read-only."""
    if reading and n <= SMALL_BYTES and table.mem >= 0:
        try:
            got = os.preadv(table.mem, [memory(local, n)], remote)
        except OSError as e:
            return e.errno or errno.EIO
        return 0 if got == n else errno.EIO
    _prepare(local, n)
    pid, pieces = table.owner.pid, parts(n)
    if len(pieces) == 1:
        return _vm(reading, pid, local, remote, n)
    errs = list(_pool().map(lambda p: _vm(reading, pid, local + p[0], remote + p[0], p[1]), pieces))
    return next((e for e in errs if e), 0)


def _vm(reading: bool, pid: int, local: int, remote: int, n: int) -> int:
    """process_vm_readv/writev of n bytes until all moved: 0, or the errno of a failure."""
    call, done = _CALLS["process_vm_readv" if reading else "process_vm_writev"], 0
    while done < n:
        local_iov, remote_iov = _iovec(local + done, n - done), _iovec(remote + done, n - done)
        got = call(pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
        if got <= 0:
            return ctypes.get_errno() or errno.EIO
        done += got
    return 0


def parts(n: int) -> list[tuple[int, int]]:
    """(start, length) of the parts a copy of n bytes is split into: one below SPLIT_BYTES or on one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    k = min(COPY_THREADS, cores) if n >= SPLIT_BYTES else 1
    step = (-(-n // k) + 4095) // 4096 * 4096 if k > 1 else n
    return [(at, min(step, n - at)) for at in range(0, n, step)]


def _prepare(local: int, n: int) -> None:
    """This process's side of a large copy on huge pages, once per region (as RDMA registers a local buffer once):
    a repeated transfer into the same tensor pays it the first time only."""
    if n < HUGE_BYTES or (local, n) in _prepared:
        return
    prefer_huge_pages(local, n)
    _prepared[(local, n)] = None
    while len(_prepared) > PREPARED:
        _prepared.popitem(last=False)


PREPARED = 64  # local regions remembered as prepared
_prepared: OrderedDict[tuple[int, int], None] = OrderedDict()
_copiers: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    with _tables_lock:
        if not _copiers:
            _copiers.append(ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="monarch-copy"))
    return _copiers[0]


def _open_mem(pid: int) -> int:
    """A read-only descriptor of the owner's /proc/<pid>/mem for small reads; -1 where it cannot be opened
    (process_vm_readv then does every copy)."""
    try:
        return os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _table(owner: Owner) -> Table:
    key = (owner.pid, owner.started, owner.table_fd)
    table = _tables.get(key)
    if table is None:
        _check_alive(owner)
        with _tables_lock:
            table = _tables.get(key) or Table(owner)
            _tables[key] = table
    return table


def _check_alive(owner: Owner) -> None:
    if start_time(owner.pid) != owner.started:
        _tables.pop((owner.pid, owner.started, owner.table_fd), None)
        raise _dead(owner)


def _dead(owner: Owner) -> TransportError:
    return TransportError(f"RDMA transfer failed: the buffer's owner, {owner}, has exited")
