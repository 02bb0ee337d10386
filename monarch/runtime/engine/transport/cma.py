"""Same-node transfers by cross-memory attach (process_vm_readv / process_vm_writev): one copy, straight
between the two processes' memory, and the owner runs nothing for it.

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
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from monarch.errors import TransportError
from monarch.runtime.engine.transport.handle import Handle, Owner, start_time, this_node
from monarch.runtime.engine.transport.registry import SLOT, SLOT_BYTES


class Refused(Exception):
    """This kernel does not let this process attach to the owner's memory."""


class _iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_CALLS = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
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
        self._map: mmap.mmap | None = None
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def record(self, slot: int) -> tuple[int, int, int, int, bytes]:
        end = (slot + 1) * SLOT_BYTES
        if self._map is None or len(self._map) < end:
            size = os.fstat(self.fd).st_size
            if size < end:
                return (0, 0, 0, 0, bytes(16))
            self._map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ)
        return SLOT.unpack_from(self._map, slot * SLOT_BYTES)

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
    _copy("process_vm_readv", handle, offset, n, addr)


def write(handle: Handle, offset: int, n: int, addr: int) -> None:
    """Copy n bytes from this process's address `addr` to the owner's bytes at `offset`."""
    _copy("process_vm_writev", handle, offset, n, addr)


def read_memory(pid: int, remote: int, local: int, n: int) -> None:
    """Copy n bytes at address `remote` of process `pid` to this process's address `local`, with no slot table:
    the caller knows the memory is alive. `Refused` where the kernel forbids the attach, OSError otherwise."""
    done = 0
    while done < n:
        local_iov, remote_iov = _iovec(local + done, n - done), _iovec(remote + done, n - done)
        got = _CALLS["process_vm_readv"](pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() or errno.EIO
            if err == errno.EPERM:
                raise Refused()
            raise OSError(err, os.strerror(err))
        done += got


def _copy(call: str, handle: Handle, offset: int, n: int, local: int) -> None:
    """A read checks the slot before and after its copy (a drop in between, which may have freed the memory,
    fails it: never stale bytes) and takes no lock; a write holds the slot's shared lock, so the region cannot
    be dropped and its memory reused while the bytes land."""
    table = _table(handle.owner)
    if call == "process_vm_readv":
        _check_slot(table, handle)
        _attach(call, handle, offset, n, local, table)
        _check_slot(table, handle)
        return
    with table.holding(handle.slot):
        _check_slot(table, handle)
        _attach(call, handle, offset, n, local, table)


def _check_slot(table: Table, handle: Handle) -> None:
    live, gen, addr, size, key = table.record(handle.slot)
    if not live or gen != handle.gen or not secrets.compare_digest(key, handle.key) or addr != handle.addr \
            or size != handle.size:
        _check_alive(handle.owner)
        raise TransportError(f"no RDMA buffer {handle.slot}.{handle.gen} at {handle.owner}: it was dropped, or "
                             "the handle is not one that process registered")


def _attach(call: str, handle: Handle, offset: int, n: int, local: int, table: Table) -> None:
    done = 0
    while done < n:
        local_iov = _iovec(local + done, n - done)
        remote_iov = _iovec(handle.addr + offset + done, n - done)
        got = _CALLS[call](handle.owner.pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                raise Refused()
            _check_alive(handle.owner)
            _check_slot(table, handle)  # dropped meanwhile
            raise TransportError(f"RDMA transfer with {handle.owner} failed: {os.strerror(err)}")
        done += got


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
