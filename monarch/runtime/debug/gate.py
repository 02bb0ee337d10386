"""The front door of a listening socket: one selector loop accepts connections and authenticates them.

A peer that has not proven itself costs a socket and a few bytes, never a thread nor a serving slot: it has
its handshake's deadline to answer; one peer (`user_of`: the user owning the other end of a loopback
connection, else its address; `address_of`: its address) has at most `Caps.per_peer` connections waiting,
all peers together `Caps.total`; past either cap, first the answers that arrived are read, then the oldest
waiting connection of that peer (or of the busiest one) is closed, so a flood cannot keep anyone else out.
Authenticated sockets are handed on, blocking. Two handshakes use it: the admin endpoint's token (`Token`,
debug/admin.py) and attach mode's challenge (cluster/wire.py). `Throttled` keeps a flood from flooding the log too.
"""
from __future__ import annotations

import errno
import hmac
import logging
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

ACCEPT_BATCH = 64  # accepted per turn of the loop, so that waiting peers are read in between
LOG_PERIOD_S = 1.0  # at most one log line of a kind per period
PROC_NET_TCP = "/proc/net/tcp"


class Handshake(Protocol):
    """How a connection proves itself: what it is greeted with, how many bytes it answers, what decides."""
    deadline_s: float  # the time a new connection has, in all, to answer
    answer_bytes: int
    refusal: bytes  # sent to a peer whose answer is wrong (b"": nothing)

    def greet(self) -> tuple[bytes, bytes]:
        """(what the connection is sent first, what its answer is checked against)."""
        ...

    def check(self, challenge: bytes, answer: bytes) -> bytes | None:
        """What an authenticated peer is sent (b"": nothing), or None when `answer` is wrong."""
        ...


@dataclass(frozen=True)
class Token:
    """The simplest handshake: the peer sends a secret token, compared in constant time; no greeting."""
    token: bytes
    deadline_s: float = 1.0
    refusal: bytes = b""

    @property
    def answer_bytes(self) -> int:
        return len(self.token)

    def greet(self) -> tuple[bytes, bytes]:
        return b"", b""

    def check(self, challenge: bytes, answer: bytes) -> bytes | None:
        return b"" if hmac.compare_digest(answer, self.token) else None


@dataclass(frozen=True)
class Caps:
    """How many unauthenticated connections may wait: of one peer, and of all peers together."""
    per_peer: int = 64
    total: int = 256


def address_of(conn: socket.socket) -> str:
    """Whose a connection is, when peers are hosts: its address."""
    return f"address {conn.getpeername()[0]}"


def user_of(conn: socket.socket) -> str:
    """Whose a connection is, when peers are local users: the user id owning the other end of a loopback
    connection (Linux's /proc/net/tcp), else its address."""
    (ip, port), (here, our_port) = conn.getpeername()[:2], conn.getsockname()[:2]
    if conn.family == socket.AF_INET:
        theirs, ours = _hex(ip, port), _hex(here, our_port)
        with suppress(OSError), open(PROC_NET_TCP) as table:
            for line in table:
                fields = line.split()
                if len(fields) > 7 and fields[1] == theirs and fields[2] == ours:
                    return f"uid {fields[7]}"
    return f"address {ip}"


def _hex(ip: str, port: int) -> str:
    """An IPv4 address and port as /proc/net/tcp writes them (the address as a native-endian integer)."""
    return "%08X:%04X" % (struct.unpack("=I", socket.inet_aton(ip))[0], port)


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
    """A connection greeted with `challenge` that has until `deadline` to answer."""
    peer: str  # whose it is, for the caps
    address: str  # host:port
    challenge: bytes
    deadline: float
    got: bytes = b""


class Gate:
    """Accepts on `listener` until it is shut down and hands each authenticated socket and its address
    (host:port) to `admit`, which must not block; the rest are closed."""

    def __init__(self, listener: socket.socket, handshake: Handshake, admit: Callable[[socket.socket, str], None],
                 caps: Caps = Caps(), log: logging.Logger | None = None,
                 peer_of: Callable[[socket.socket], str] = user_of) -> None:
        self.listener, self.handshake, self.admit, self.caps = listener, handshake, admit, caps
        self.log = Throttled(log or logging.getLogger("monarch.gate"))
        self.peer_of = peer_of  # whose a connection is, for the caps
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest (= earliest deadline) first

    def run(self) -> None:
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        turning = True
        try:
            while turning:
                turning = self._turn()
        finally:
            for conn in list(self._waiting):
                self._drop(conn)
            self._sel.close()
            self.listener.close()

    def _turn(self) -> bool:
        """Accept, read and expire what is due; False once the listener is shut down."""
        first = next(iter(self._waiting.values()), None)
        timeout = None if first is None else max(first.deadline - time.monotonic(), 0.0)
        for key, _ in self._sel.select(timeout):
            if key.fileobj in self._waiting:  # not dropped or admitted since the select
                self._read(key.fileobj)  # type: ignore[arg-type]
            elif key.fileobj is self.listener and not self._accept():
                return False
        now = time.monotonic()
        while (first := next(iter(self._waiting.values()), None)) is not None and first.deadline <= now:
            self._drop(next(iter(self._waiting)), "silent", logging.WARNING,
                       "dropped %s before it authenticated: no answer within %.1f s", first.address,
                       self.handshake.deadline_s)
        return True

    def _accept(self) -> bool:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.EBADF):  # shut down: the endpoint is closed
                    return False
                self.log.log("accept", logging.WARNING, "cannot accept a connection: %s", e)
                if self._waiting:  # out of descriptors: the oldest waiting connection makes room
                    self._drop(next(iter(self._waiting)))
                else:
                    time.sleep(0.05)
                return True
            self._greet(conn)
        return True

    def _greet(self, conn: socket.socket) -> None:
        hello, challenge = self.handshake.greet()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer, address = self.peer_of(conn), "%s:%d" % conn.getpeername()[:2]
            if hello:
                conn.sendall(hello)  # a few bytes into an empty buffer
        except OSError:  # already gone
            conn.close()
            return
        self._make_room(peer)
        self._waiting[conn] = _Waiting(peer, address, challenge, time.monotonic() + self.handshake.deadline_s)
        self._sel.register(conn, selectors.EVENT_READ)

    def _make_room(self, peer: str) -> None:
        """Below `caps.per_peer` for `peer` and `caps.total` in all: first take the answers that arrived."""
        for cap, whose in ((self.caps.per_peer, peer), (self.caps.total, None)):
            waiting = [c for c, w in self._waiting.items() if whose is None or w.peer == whose]
            if len(waiting) < cap:
                continue
            for conn in waiting:
                self._read(conn)
            waiting = [c for c in waiting if c in self._waiting]
            why = f"{cap} of its connections wait" if whose else f"{cap} connections wait"
            while len(waiting) >= cap:
                busiest = Counter(self._waiting[c].peer for c in waiting).most_common(1)[0][0]
                oldest = next(c for c in waiting if self._waiting[c].peer == busiest)
                waiting.remove(oldest)
                self._drop(oldest, "full", logging.WARNING, "dropped %s before it authenticated to make room: %s",
                           self._waiting[oldest].address, why)

    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting[conn]
        try:
            data = conn.recv(self.handshake.answer_bytes - len(waiting.got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # a readiness probe (Kubernetes' tcpSocket), a port scan
            self._drop(conn, "closed", logging.DEBUG, "%s closed its connection before it authenticated",
                       waiting.address)
            return
        waiting.got += data
        if len(waiting.got) == self.handshake.answer_bytes:
            self._decide(conn, waiting)

    def _decide(self, conn: socket.socket, waiting: _Waiting) -> None:
        reply = self.handshake.check(waiting.challenge, waiting.got)
        self._sel.unregister(conn)
        del self._waiting[conn]
        if reply is None:
            with suppress(OSError):
                conn.send(self.handshake.refusal)
            conn.close()
            self.log.log("wrong", logging.WARNING, "dropped %s: it does not know the secret", waiting.address)
            return
        try:
            if reply:
                conn.sendall(reply)
            conn.setblocking(True)
        except OSError:
            conn.close()
            return
        self.admit(conn, waiting.address)

    def _drop(self, conn: socket.socket, kind: str = "", level: int = logging.DEBUG, msg: str = "",
              *args: object) -> None:
        if self._waiting.pop(conn, None) is not None:
            self._sel.unregister(conn)
            conn.close()
            if msg:
                self.log.log(kind, level, msg, *args)
