"""The attach agent's door: one selector loop accepts every connection and authenticates it (wire.py).

A peer that has not proven the secret costs a socket and a few bytes, never a thread: it has
AUTH_DEADLINE_S to prove it, and at most MAX_WAITING_PER_PEER such connections of one address (MAX_WAITING
in all) wait; a new one closes the oldest waiting one over a cap, so a flood cannot keep a controller
out. `Throttled` keeps a flood from flooding the log too: one line per kind per second at most.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from monarch.cluster import wire

log = logging.getLogger("monarch.agent")

MAX_WAITING = 512  # connections that have not authenticated yet, of all peers
MAX_WAITING_PER_PEER = 64  # ... of one address
ACCEPT_BATCH = 64  # accepted per turn of the loop, so that waiting peers are read in between
LOG_PERIOD_S = 1.0  # at most one log line of a kind per period


class Throttled:
    """A logger that writes at most one line per kind per `period` s; the next line of a kind says how
    many were left out since the last one."""

    def __init__(self, logger: logging.Logger, period: float = LOG_PERIOD_S) -> None:
        self.logger, self.period = logger, period
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (when its last line went out, left out since)
        self._lock = threading.Lock()

    def log(self, kind: str, level: int, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            last, skipped = self._kinds.get(kind, (now - self.period, 0))
            if now - last < self.period:
                self._kinds[kind] = (last, skipped + 1)
                return
            self._kinds[kind] = (now, 0)
        if skipped:
            msg = f"{msg} (and {skipped} more like it in the last {now - last:.0f} s)"
        self.logger.log(level, msg, *args)


@dataclass
class _Waiting:
    """A connection that has been greeted with `nonce` and has until `deadline` to answer."""
    sock: socket.socket
    peer: str  # host:port
    ip: str
    nonce: bytes
    deadline: float
    got: bytes = b""


class Gate:
    """Accepts on `listener` forever and hands each authenticated socket (blocking, the handshake done)
    and its peer to `admit`, which must not block."""

    def __init__(self, listener: socket.socket, secret: bytes, admit: Callable[[socket.socket, str], None]) -> None:
        self.listener, self.secret, self.admit = listener, secret, admit
        self.log = Throttled(log)
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest (= earliest deadline) first
        self._by_ip: dict[str, dict[socket.socket, None]] = {}  # each peer's, oldest first

    def serve_forever(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        try:
            while True:
                self._turn()
        finally:
            for waiting in list(self._waiting.values()):
                self._drop(waiting)
            self._selector.close()

    def _turn(self) -> None:
        oldest = next(iter(self._waiting.values()), None)
        timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            elif (waiting := self._waiting.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                self._read(waiting)
        now = time.monotonic()
        while (oldest := next(iter(self._waiting.values()), None)) is not None and oldest.deadline <= now:
            self._drop(oldest, "silent", logging.WARNING, "dropped %s before it authenticated: no proof within "
                       "%.1f s", oldest.peer, wire.AUTH_DEADLINE_S)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of file descriptors: the oldest waiting peer makes room
                self.log.log("accept", logging.WARNING, "cannot accept a connection: %s", e)
                if self._waiting:
                    self._drop(next(iter(self._waiting.values())))
                else:
                    time.sleep(0.05)
                return
            self._greet(sock, addr[0], "%s:%d" % addr[:2])

    def _greet(self, sock: socket.socket, ip: str, peer: str) -> None:
        nonce, hello = wire.agent_hello()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello)  # a few bytes into an empty buffer
        except OSError:
            sock.close()
            return
        self._make_room(ip)
        self._waiting[sock] = _Waiting(sock, peer, ip, nonce, time.monotonic() + wire.AUTH_DEADLINE_S)
        self._by_ip.setdefault(ip, {})[sock] = None
        self._selector.register(sock, selectors.EVENT_READ)

    def _make_room(self, ip: str) -> None:
        """Close the oldest waiting connection of `ip` when it has its cap of them, else of all peers when
        they have theirs: a controller's handshake takes a round trip, a flood's last until the deadline."""
        mine = self._by_ip.get(ip, {})
        if len(mine) >= MAX_WAITING_PER_PEER:
            oldest, why = self._waiting[next(iter(mine))], f"{MAX_WAITING_PER_PEER} of its address wait"
        elif len(self._waiting) >= MAX_WAITING:
            oldest, why = next(iter(self._waiting.values())), f"{MAX_WAITING} connections wait"
        else:
            return
        self._drop(oldest, "full", logging.WARNING, "dropped %s before it authenticated to make room: %s",
                   oldest.peer, why)

    def _read(self, waiting: _Waiting) -> None:
        try:
            data = waiting.sock.recv(wire.ANSWER_BYTES - len(waiting.got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # a readiness probe (Kubernetes' tcpSocket), a port scan
            self._drop(waiting, "closed", logging.DEBUG, "%s closed its connection before it authenticated",
                       waiting.peer)
            return
        waiting.got += data
        if len(waiting.got) == wire.ANSWER_BYTES:
            self._decide(waiting)

    def _decide(self, waiting: _Waiting) -> None:
        proof = wire.agent_proof(self.secret, waiting.nonce, waiting.got)
        if proof is None:
            with suppress(OSError):
                waiting.sock.send(wire.DENIED)
            self._drop(waiting, "secret", logging.WARNING, "dropped %s: it does not know the secret", waiting.peer)
            return
        self._forget(waiting)
        try:
            waiting.sock.sendall(proof)
            waiting.sock.setblocking(True)
        except OSError:
            waiting.sock.close()
            return
        self.admit(waiting.sock, waiting.peer)

    def _forget(self, waiting: _Waiting) -> None:
        self._selector.unregister(waiting.sock)
        del self._waiting[waiting.sock]
        mine = self._by_ip[waiting.ip]
        del mine[waiting.sock]
        if not mine:
            del self._by_ip[waiting.ip]

    def _drop(self, waiting: _Waiting, kind: str = "", level: int = logging.DEBUG, msg: str = "",
              *args: object) -> None:
        self._forget(waiting)
        waiting.sock.close()
        if msg:
            self.log.log(kind, level, msg, *args)
