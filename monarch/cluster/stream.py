"""How a sync's files reach each host: streamed over a TCP connection of their own, or in control-plane frames.

A host's writer opens a `Door` (a one-connection listener on the address its peers reach it at, with a fresh
key); the controller connects, proves the key and streams each file as a header (path length, size, mode),
the path and the bytes, straight from its page cache (sendfile), to every host at once; a header with an
empty path ends the stream. Where no door can be reached, the files go in batches of `write` calls instead.
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monarch import config
from monarch.cluster.copies import Manifest, Piece, WorkspaceError, begin, create, land

if TYPE_CHECKING:
    from monarch.runtime.actors.actor_mesh import ActorMesh
    from monarch.runtime.control.futures import Future

KEY_BYTES = 16
HEAD = struct.Struct("<IQI")  # path length in bytes (0 ends the stream), file size, permission bits
TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO / SO_SNDTIMEO
BUFFER = 1 << 20  # bytes per receive
POLL_S = 0.2  # how often a door waiting for its connection checks whether it was closed
KEY_S = 5.0  # seconds a connection has to send the key
CONNECT_S = 5.0  # seconds the controller tries to reach a door before it sends in frames instead
ENTRY_BYTES = 160  # pickled size of one piece's fields besides its path and data
WINDOW = 4  # write calls in flight per host

Signature = tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode: every write or rename changes it


def signature(st: os.stat_result) -> Signature:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class Door:
    """One stream of files into `copy`: a thread accepts the controller's connection (its first bytes must
    be the key) and lands the files; `close` stops waiting, joins it and raises what went wrong."""

    def __init__(self, host: str, copy: Path, timeout: float) -> None:
        self.copy, self.key, self.deadline = copy, secrets.token_bytes(KEY_BYTES), time.monotonic() + timeout
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(POLL_S)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.files = 0
        self.error: BaseException | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monarch-workspace-door", daemon=True)
        self._thread.start()

    def close(self) -> int:
        """The number of files landed; raises the error that ended the stream."""
        self._closing.set()
        self._thread.join(max(0.0, self.deadline - time.monotonic()) + POLL_S)
        if self._thread.is_alive():
            raise WorkspaceError(f"the stream into {self.copy} did not end in time; sync again with a longer "
                                 "timeout")
        if self.error is not None:
            raise self.error
        return self.files

    def _run(self) -> None:
        try:
            sock = self._accept()
            if sock is not None:
                with sock:
                    self._receive(sock)
        except (ConnectionError, TimeoutError, BlockingIOError) as e:
            self.error = WorkspaceError(f"the stream into {self.copy} ended early: {e}; the controller stopped "
                                        "sending (see its error) or lost the connection; sync again")
        except BaseException as e:  # noqa: BLE001 - raised again by close(), on the actor's thread
            self.error = e
        finally:
            self.listener.close()

    def _accept(self) -> socket.socket | None:
        """The controller's connection, once it proved the key; None when the door closes first."""
        while not self._closing.is_set() and time.monotonic() < self.deadline:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            try:
                sock.settimeout(KEY_S)
                if hmac.compare_digest(recv_exact(sock, KEY_BYTES), self.key):
                    return blocking(sock, self.deadline)
            except OSError:
                pass  # not the controller: keep waiting for it
            sock.close()
        return None

    def _receive(self, sock: socket.socket) -> None:
        buf = memoryview(bytearray(BUFFER))
        while True:
            n, size, mode = HEAD.unpack(recv_exact(sock, HEAD.size))
            if n == 0:
                sock.sendall(b"\0")  # the last file landed
                return
            self._land(sock, os.fsdecode(recv_exact(sock, n)), size, mode, buf)
            self.files += 1

    def _land(self, sock: socket.socket, rel: str, size: int, mode: int, buf: memoryview) -> None:
        dest, part = begin(self.copy, rel)
        fd = create(part)
        try:
            left = size
            while left:
                got = sock.recv_into(buf, min(left, len(buf)), socket.MSG_WAITALL)
                if not got:
                    raise WorkspaceError(f"the stream ended inside {rel}; the controller stopped sending (see its "
                                         "error) or lost the connection; sync again")
                written = 0
                while written < got:
                    written += os.write(fd, buf[written:got])
                left -= got
            os.fchmod(fd, mode & 0o777)
        finally:
            os.close(fd)
        land(part, dest)


def blocking(sock: socket.socket, deadline: float) -> socket.socket:
    """`sock` made blocking, each of its sends and receives bounded by the time left until `deadline`: whole
    buffers move in one call (MSG_WAITALL, sendfile without polls)."""
    sock.settimeout(None)
    left = max(0.01, deadline - time.monotonic())
    limit = TIMEVAL.pack(int(left), int(left % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the peer closed the stream ({len(data)} of {n} bytes of a header came)")
        data += chunk
    return bytes(data)


def connect(address: tuple[str, int], key: bytes, deadline: float) -> socket.socket:
    """A connection into the door at `address`, its key sent; OSError when it cannot be reached by `deadline`."""
    sock = socket.create_connection(address, timeout=max(0.01, deadline - time.monotonic()))
    try:
        sock.sendall(key)
    except OSError:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, root: Path, files: Iterable[tuple[str, int, Signature]], deadline: float) -> None:
    """Stream `files` ((relpath, permission bits, the signature it was hashed with)) under `root` into the door
    `sock` is connected to, and wait until it landed them. WorkspaceError: a file changed since it was hashed;
    OSError: the door closed the stream (it says why) or the connection broke."""
    with blocking(sock, deadline):
        for rel, mode, sig in files:
            _send_file(sock, root, rel, mode, sig)
        sock.sendall(HEAD.pack(0, 0, 0))
        if recv_exact(sock, 1) != b"\0":
            raise ConnectionError("the door did not confirm the end of the stream")


def _send_file(sock: socket.socket, root: Path, rel: str, mode: int, sig: Signature) -> None:
    path = os.fsencode(rel)
    with open(root / rel, "rb") as f:
        size = sig[0]
        sock.sendall(HEAD.pack(len(path), size, mode) + path)
        sent = sock.sendfile(f, 0, size) if size else 0
        if sent < size or signature(os.fstat(f.fileno())) != sig:
            raise WorkspaceError(f"{root / rel} changed while it was being sent; sync again")


# --- the controller's side: what goes where, and the frames ------------------------------------------

def batches(root: Path, wanted: list[str], files: Manifest, budget: int) -> Iterator[list[Piece]]:
    """The wanted files as write batches: small files share a batch, a large one goes in pieces."""
    batch: list[Piece] = []
    used = 0
    for rel in wanted:
        size, sha, mode = files[rel]
        meta = len(os.fsencode(rel)) + ENTRY_BYTES
        with open(root / rel, "rb") as f:
            offset = 0
            while True:
                room = budget - used - meta
                if room <= 0:
                    if not batch:
                        raise WorkspaceError(f"the path {rel!r} is too long to send within MONARCH_MAX_FRAME; raise it")
                    yield batch
                    batch, used = [], 0
                    continue
                want = min(room, size - offset)
                data = f.read(want)
                if len(data) < want:
                    raise WorkspaceError(f"{root / rel} shrank while it was being sent; sync again")
                batch.append((rel, offset, data, size, sha, mode))
                used += meta + len(data)
                offset += len(data)
                if offset >= size:
                    break
    if batch:
        yield batch


def left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def deliver(hosts: dict[str, ActorMesh], wanted: dict[str, list[str]], name: str, root: Path, files: Manifest,
            sigs: dict[str, Signature], budget: int, deadline: float, hashed: Callable[[], Manifest]) -> dict[str, str]:
    """Send each host the files it lacks: streamed (MONARCH_WORKSPACE_STREAM) where its door can be reached,
    in control-plane frames otherwise (their pieces carry the hashes: `hashed()` gives the manifest with all of
    them). hostname -> "stream", "frames" or "" (nothing to send)."""
    sending = {host: agent for host, agent in hosts.items() if wanted[host]}
    streamed = stream_files(sending, wanted, name, root, files, sigs, deadline) if config.workspace_stream() \
        else set()
    framed = {host: agent for host, agent in sending.items() if host not in streamed}
    if framed:
        send_files(framed, wanted, name, root, hashed(), budget, deadline)
    return {host: "stream" if host in streamed else "frames" if host in framed else "" for host in hosts}


def stream_files(hosts: dict[str, ActorMesh], wanted: dict[str, list[str]], name: str, root: Path,
                 files: Manifest, sigs: dict[str, Signature], deadline: float) -> set[str]:
    """Stream each host its wanted files through the door its writer opens, all hosts at once; the hosts
    whose door could not be opened or reached (within CONNECT_S) are left out of the answer."""
    doors = each(hosts, lambda a: a.open_door.call_one(name, left(deadline)), deadline)
    socks = {}
    for host, door in doors.items():
        if door is not None:
            with suppress(OSError):
                socks[host] = connect(door[:2], door[2], min(deadline, time.monotonic() + CONNECT_S))
    errors: dict[str, BaseException] = {}

    def run(host: str) -> None:
        try:
            send(socks[host], root, [(rel, files[rel][2], sigs[rel]) for rel in wanted[host]], deadline)
        except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
            errors[host] = e
    threads = [threading.Thread(target=run, args=(host,), name="monarch-workspace-send") for host in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for host, e in errors.items():
        if isinstance(e, WorkspaceError):
            raise e
        hosts[host].finish.call_one(name).get(timeout=left(deadline))  # raises why the door closed on us
        raise WorkspaceError(f"streaming the workspace to {host} failed: {e!r}; sync again") from e
    return set(socks)


def send_files(hosts: dict[str, ActorMesh], wanted: dict[str, list[str]], name: str, root: Path,
               files: Manifest, budget: int, deadline: float) -> None:
    """Write each host's wanted files, hosts taking turns, at most WINDOW calls in flight per host."""
    streams = {host: batches(root, wanted[host], files, budget) for host in hosts}
    inflight: deque[Future[None]] = deque()
    while streams:
        for host, pieces in list(streams.items()):
            batch = next(pieces, None)
            if batch is None:
                del streams[host]
                continue
            inflight.append(hosts[host].write.call_one(name, batch))
            while len(inflight) > WINDOW * len(hosts):
                inflight.popleft().get(timeout=left(deadline))
    for fut in inflight:
        fut.get(timeout=left(deadline))


def each(hosts: dict[str, ActorMesh], call: Callable[[ActorMesh], Future[Any]], deadline: float) -> dict[str, Any]:
    """Start `call(agent)` on every host's writer, then wait for all: hostname -> answer."""
    futures = {host: call(agent) for host, agent in hosts.items()}
    return {host: fut.get(timeout=left(deadline)) for host, fut in futures.items()}
