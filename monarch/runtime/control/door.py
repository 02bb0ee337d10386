"""The controller's listening sockets: where workers and monitors connect back, and how they get in.

`Door` binds one listener per host it is asked for (loopback by default; workers connect back to the address the
controller advertises), accepts on the poller, gives each connection HANDSHAKE_TIMEOUT to send its header, and
checks the header against the job it names (the job's token; a worker's rank in range and not taken) before any
frame of it is decoded. Then `ConnReader` splits the connection's frames and hands each message to the
controller (`Peers`).
"""
from __future__ import annotations

import itertools
import logging
import socket
from typing import Any, Protocol

from monarch.errors import TransportError
from monarch.runtime.control import codec
from monarch.runtime.control.commands import CONTROLLER
from monarch.runtime.control.conn import Conn, Job
from monarch.runtime.control.poller import Poller

log = logging.getLogger("monarch.controller")
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to send its header


class Peers(Protocol):
    """Where an authenticated connection's messages go, and who hears that it closed (the Controller)."""

    def handle(self, conn: Conn, msg: Any) -> None: ...

    def peer_closed(self, conn: Conn) -> None: ...


class Door:
    """The listeners and the connections that have not sent their handshake yet."""

    def __init__(self, poller: Poller, jobs: dict[int, Job], peers: Peers) -> None:
        self.poller, self.jobs, self.peers = poller, jobs, peers
        self._addrs = itertools.count(CONTROLLER + 1)
        self._listeners: dict[str, str] = {}  # bind host -> "host:port"
        self._handshaking: set[Conn] = set()

    def listen(self, host: str) -> str:
        """The "host:port" workers connect back to, with a listening socket bound to `host`."""
        if host not in self._listeners:
            listener = socket.create_server((host, 0))
            listener.setblocking(False)
            self.poller.watch(listener.fileno(), lambda: self._accept(listener))
            self._listeners[host] = "%s:%d" % listener.getsockname()[:2]
        return self._listeners[host]

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock, next(self._addrs), self.poller)
        self._handshaking.add(conn)
        self.poller.watch(sock.fileno(), ConnReader(self, conn))

    def expire(self, now: float) -> float:
        """Drop the connections whose handshake is late; seconds until this should run again."""
        if not self._handshaking:
            return 1.0
        for conn in list(self._handshaking):
            if now - conn.opened > HANDSHAKE_TIMEOUT:
                log.warning("monarch controller: dropped a connection that sent no handshake in time")
                self.close(conn)
        return 0.5

    def authenticate(self, conn: Conn, header: codec.Header | None) -> bool:
        """Whether `header` opens `conn` into its job; the job then knows the connection of that rank."""
        mesh = self.jobs.get(header.mesh_id) if header else None
        if header is None or mesh is None or not header.authentic(mesh.token):
            log.warning("monarch controller: rejected a connection with a bad handshake")
            return False
        if header.role == codec.ROLE_WORKER:
            if not 0 <= header.rank < len(mesh.shape) or mesh.conns[header.rank] is not None:
                log.warning("monarch controller: rejected a duplicate or out-of-range worker rank %d", header.rank)
                return False
            mesh.conns[header.rank] = conn
        conn.header, conn.mesh = header, mesh
        conn.reader.max_frame = mesh.max_frame
        self._handshaking.discard(conn)
        log.debug("mesh %r: rank %d connected (%s)", mesh.name, header.rank,
                  "worker" if header.role == codec.ROLE_WORKER else "monitor")
        return True

    def close(self, conn: Conn) -> None:
        self._handshaking.discard(conn)
        if conn.sock.fileno() >= 0:
            self.poller.unwatch(conn.sock.fileno())
            conn.sock.close()


class ConnReader:
    """The poll handler of one connection: its handshake first (checked by `door`), then frames, each message
    handed to the door's peers."""

    def __init__(self, door: Door, conn: Conn) -> None:
        self.door, self.conn = door, conn

    def __call__(self) -> None:
        conn = self.conn
        try:
            data = conn.sock.recv(codec.RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.door.peers.peer_closed(conn)
            return
        conn.fresh = True
        if conn.header is None:
            conn.head += data
            if len(conn.head) < codec.HEADER_SIZE:
                return
            data, conn.head = conn.head[codec.HEADER_SIZE:], conn.head[:codec.HEADER_SIZE]
            if not self.door.authenticate(conn, codec.Header.decode(conn.head)):
                self.door.close(conn)
                return
        assert conn.header is not None
        try:
            bodies = conn.reader.feed(data)
        except TransportError as e:
            log.warning("monarch controller: closing rank %s: %s", conn.header.rank, e)
            self.door.peers.peer_closed(conn)
            return
        for body in bodies:
            try:
                msgs = codec.decode_frame(body)
            except Exception as e:  # noqa: BLE001 - a malformed frame is dropped, the peer stays
                log.warning("monarch controller: dropped a malformed frame from rank %s: %r", conn.header.rank, e)
                continue
            for msg in msgs:
                self.door.peers.handle(conn, msg)
