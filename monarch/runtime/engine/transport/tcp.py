"""The TCP door of a process's registered memory, and the client side of its transfers (the fallback that
works anywhere; `onesided` picks it when no faster path reaches the owner).

A request is a fixed 56-byte header (no pickle: nothing is decoded before the handle's key is checked):
magic, op, slot, generation, key, offset, length. READ answers a status and the bytes; WRITE answers a
status, then takes the bytes straight into the region and acknowledges; DROP unregisters; VERBS trades
queue-pair addresses for the verbs backend; MPI_JOIN joins an MPI pair (mpi_rma.py), whose line the
connection then is. A bad request gets an error status naming what was wrong, then
the connection closes. Bytes move between the socket and the region's memory without a copy.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from monarch.errors import TransportError
from monarch.runtime.engine.transport.handle import Handle

HEADER = struct.Struct("<4sB3xIQ16sQQ")  # magic, op, slot, generation, key, offset, length
STATUS = struct.Struct("<BI")  # 0 ok / 1 error, then the error text's length
MAGIC = b"MRD1"
READ, WRITE, DROP, VERBS, MPI_JOIN = 1, 2, 3, 4, 5
MAX_TEXT = 4096


class Refusal(TransportError):
    """The owner answered, and refused the request (the connection stays usable)."""


class Acceptor(Protocol):
    """The verbs backend's side of the door (verbs.Device): it takes a peer's queue-pair request."""

    def accept(self, sock: socket.socket, length: int) -> None: ...


class Regions(Protocol):
    """What the door serves from (registry.Registry)."""

    @property
    def verbs(self) -> Acceptor | None: ...

    def using(self, slot: int, gen: int, key: bytes, offset: int, nbytes: int) -> AbstractContextManager[memoryview]:
        ...

    def drop(self, slot: int, gen: int, key: bytes) -> None: ...

    def check(self, slot: int, gen: int, key: bytes) -> None: ...

    def join_mpi(self, sock: socket.socket) -> None: ...


FIRST_REQUEST_S = 10.0  # a new connection must send a well-formed request this soon, or it is closed
MAX_CONNECTIONS = 256  # open connections per door; more are closed at once (another local user cannot pile up threads)


class Server:
    """Accepts on `host` (an ephemeral port) in a daemon thread; one thread per connection serves requests."""

    def __init__(self, registry: Regions, host: str) -> None:
        self.registry = registry
        self._open = 0
        self._count = threading.Lock()
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host, self.port = self._listener.getsockname()[:2]
        self._ops: dict[int, Callable[[socket.socket, tuple], None]] = {
            READ: self._read, WRITE: self._write, DROP: self._drop, VERBS: self._verbs,
            MPI_JOIN: self._mpi_join}
        threading.Thread(target=self._accept, name="monarch-rdma-door", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._count:
                full = self._open >= MAX_CONNECTIONS
                self._open += not full
            if full:
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), name="monarch-rdma-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(FIRST_REQUEST_S)
        try:
            with sock:
                while self._request(sock):
                    continue
        except OSError:  # the peer went away, or sent no request in time
            return
        finally:
            with self._count:
                self._open -= 1

    def _request(self, sock: socket.socket) -> bool:
        """Serve one request; whether the connection stays open for another."""
        raw = recv_exactly(sock, HEADER.size)
        if raw is None:
            return False
        header = HEADER.unpack(raw)
        op = self._ops.get(header[1]) if header[0] == MAGIC else None
        try:
            if op is None:
                raise TransportError("not a monarch RDMA request (bad magic or op)")
            sock.settimeout(None)  # a well-formed request: the op checks its key before anything else
            op(sock, header)
        except (TransportError, ValueError) as e:
            status(sock, str(e))
            return False
        return True

    def _read(self, sock: socket.socket, h: tuple) -> None:
        with self.registry.using(h[2], h[3], h[4], h[5], h[6]) as mem:
            status(sock, "")
            sock.sendall(mem)

    def _write(self, sock: socket.socket, h: tuple) -> None:
        with self.registry.using(h[2], h[3], h[4], h[5], h[6]) as mem:
            status(sock, "")
            if not _recv_into(sock, mem):
                return
        status(sock, "")

    def _drop(self, sock: socket.socket, h: tuple) -> None:
        self.registry.drop(h[2], h[3], h[4])
        status(sock, "")

    def _verbs(self, sock: socket.socket, h: tuple) -> None:
        if self.registry.verbs is None:
            raise TransportError("this process has no RDMA device")
        self.registry.check(h[2], h[3], h[4])  # only the holder of a live handle connects
        self.registry.verbs.accept(sock, h[6])

    def _mpi_join(self, sock: socket.socket, h: tuple) -> None:
        self.registry.check(h[2], h[3], h[4])  # only the holder of a live handle joins
        self.registry.join_mpi(sock)


# -- the client side ---------------------------------------------------------------------------------
_idle: dict[tuple[str, int], list[socket.socket]] = defaultdict(list)  # open connections, by door
_idle_lock = threading.Lock()


def read(handle: Handle, offset: int, dst: memoryview, timeout: float) -> None:
    """Copy the owner's bytes [offset, offset + len(dst)) into `dst`."""
    with _connection(handle, timeout) as sock:
        _ask(sock, handle, READ, offset, len(dst), timeout)
        if not _recv_into(sock, dst):
            raise gone(handle, "closed the connection mid-read")


def write(handle: Handle, offset: int, src: memoryview, timeout: float) -> None:
    """Copy `src` into the owner's bytes [offset, offset + len(src))."""
    with _connection(handle, timeout) as sock:
        _ask(sock, handle, WRITE, offset, len(src), timeout)
        sock.sendall(src)
        answer(sock, handle)


def drop(handle: Handle, timeout: float) -> None:
    with _connection(handle, timeout) as sock:
        _ask(sock, handle, DROP, 0, 0, timeout)


def request(handle: Handle, op: int, length: int, timeout: float) -> socket.socket:
    """A fresh connection to the owner's door with request `op` sent (the verbs backend's handshake)."""
    sock = _connect(handle, timeout)
    sock.sendall(HEADER.pack(MAGIC, op, handle.slot, handle.gen, handle.key, 0, length))
    return sock


class _connection:
    """A connection to the handle's owner, from the idle ones when there is one; it goes back to them after a
    request that went well, and is closed after one that failed."""

    def __init__(self, handle: Handle, timeout: float) -> None:
        self.handle, self.timeout, self.door = handle, timeout, (handle.owner.host, handle.owner.port)

    def __enter__(self) -> socket.socket:
        with _idle_lock:
            pool = _idle[self.door]
            idle = pool.pop() if pool else None
        self.sock = idle if idle is not None else _connect(self.handle, self.timeout)
        self.sock.settimeout(self.timeout)
        return self.sock

    def __exit__(self, kind: type | None, *_: object) -> None:
        if kind is not None:
            self.sock.close()
            if kind is socket.timeout or kind is TimeoutError:
                raise gone(self.handle, f"did not answer within {self.timeout:g} s") from None
            if issubclass(kind, OSError):
                raise gone(self.handle, "closed the connection (the process died or dropped it)") from None
            return
        with _idle_lock:
            _idle[self.door].append(self.sock)


def _connect(handle: Handle, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((handle.owner.host, handle.owner.port), timeout=max(timeout, 0.001))
    except OSError as e:
        raise gone(handle, f"cannot be reached ({e.strerror or e})") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    return sock


def _ask(sock: socket.socket, handle: Handle, op: int, offset: int, length: int, timeout: float) -> None:
    sock.sendall(HEADER.pack(MAGIC, op, handle.slot, handle.gen, handle.key, offset, length))
    answer(sock, handle)


def answer(sock: socket.socket, handle: Handle) -> None:
    """Read the owner's status; TransportError with its reason when it refused."""
    raw = recv_exactly(sock, STATUS.size)
    if raw is None:
        raise gone(handle, "closed the connection")
    failed, n = STATUS.unpack(raw)
    if failed:
        text = recv_exactly(sock, min(n, MAX_TEXT)) or b""
        raise Refusal(f"RDMA transfer refused by {handle.owner}: {text.decode(errors='replace')}")


def gone(handle: Handle, what: str) -> TransportError:
    return TransportError(f"RDMA transfer between {socket.gethostname()} (pid {os.getpid()}) and {handle.owner} "
                          f"({handle.owner.host}:{handle.owner.port}) failed: the owner {what}")


def status(sock: socket.socket, error: str) -> None:
    text = error.encode()[:MAX_TEXT]
    sock.sendall(STATUS.pack(1 if error else 0, len(text)) + text)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_into(sock, memoryview(buf)) else None


def _recv_into(sock: socket.socket, mem: memoryview) -> bool:
    """Fill `mem` from the socket; False when the peer closed first."""
    got, n = 0, len(mem)
    while got < n:
        k = sock.recv_into(mem[got:], n - got)
        if not k:
            return False
        got += k
    return True
