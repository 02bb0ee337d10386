"""The admin endpoint's front door: one thread accepts its connections and reads their tokens.

A selectors event loop waits for the tokens, so a connection that has not authenticated costs a file
descriptor, never a thread nor a serving slot. Each has TOKEN_DEADLINE_S to send its token; one peer
(the user id that owns the other end, from Linux's /proc/net/tcp, else its address) has at most
PEER_PENDING connections waiting, all peers together MAX_PENDING: past either cap, the oldest waiting
connection of that peer (or of the busiest one) is closed. Authenticated connections are handed on.
"""
from __future__ import annotations

import errno
import hmac
import selectors
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

TOKEN_BYTES = 32
TOKEN_DEADLINE_S = 1.0  # a new connection has this long, in all, to send its token
PEER_PENDING = 64       # connections of one peer that may wait for their token at once
MAX_PENDING = 256       # and of all peers together
PROC_NET_TCP = "/proc/net/tcp"


@dataclass
class _Waiting:
    """A connection whose token is not complete yet."""
    peer: str
    deadline: float
    got: bytes = b""


class Gate:
    """Accepts on `listener` (until it is shut down) and passes each connection that sent `token` to
    `admit`, which must not block; the rest are closed."""

    def __init__(self, listener: socket.socket, token: bytes, admit: Callable[[socket.socket], None]) -> None:
        assert len(token) == TOKEN_BYTES, len(token)
        self.listener, self.token, self.admit = listener, token, admit
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest first

    def run(self) -> None:
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        try:
            while True:
                first = next(iter(self._waiting.values()), None)
                timeout = None if first is None else max(first.deadline - time.monotonic(), 0.0)
                for key, _ in self._sel.select(timeout):
                    if key.fileobj in self._waiting:  # not dropped or admitted since the select
                        self._read(key.fileobj)  # type: ignore[arg-type]
                    elif key.fileobj is self.listener and not self._accept():
                        return
                self._expire()
        finally:
            for conn in list(self._waiting):
                self._drop(conn)
            self._sel.close()
            self.listener.close()

    def _accept(self) -> bool:
        """Take one new connection; False once the listener is shut down."""
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return True
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EBADF):  # shut down: the endpoint is closed
                return False
            if e.errno in (errno.EMFILE, errno.ENFILE) and self._waiting:  # out of descriptors
                self._drop(next(iter(self._waiting)))  # the oldest waiting connection makes room
            elif e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.05)  # held by others: try again soon
            return True
        try:
            conn.setblocking(False)
            peer = peer_of(conn)
        except OSError:  # already gone
            conn.close()
            return True
        self._make_room(peer)
        self._waiting[conn] = _Waiting(peer, time.monotonic() + TOKEN_DEADLINE_S)
        self._sel.register(conn, selectors.EVENT_READ)
        return True

    def _make_room(self, peer: str) -> None:
        """Below PEER_PENDING for `peer` and MAX_PENDING in all: first take the tokens that arrived."""
        for cap, whose in ((PEER_PENDING, peer), (MAX_PENDING, None)):
            waiting = [c for c, w in self._waiting.items() if whose is None or w.peer == whose]
            if len(waiting) < cap:
                continue
            for conn in waiting:
                self._read(conn)
            waiting = [c for c in waiting if c in self._waiting]
            while len(waiting) >= cap:
                busiest = Counter(self._waiting[c].peer for c in waiting).most_common(1)[0][0]
                oldest = next(c for c in waiting if self._waiting[c].peer == busiest)
                waiting.remove(oldest)
                self._drop(oldest)

    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting[conn]
        try:
            data = conn.recv(TOKEN_BYTES - len(waiting.got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        waiting.got += data
        if len(waiting.got) < TOKEN_BYTES:
            return
        self._sel.unregister(conn)
        del self._waiting[conn]
        if hmac.compare_digest(waiting.got, self.token):
            self.admit(conn)
        else:
            conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            conn, first = next(iter(self._waiting.items()))
            if first.deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if self._waiting.pop(conn, None) is not None:
            self._sel.unregister(conn)
            conn.close()


def peer_of(conn: socket.socket) -> str:
    """Who connected: the user id owning the other end of this loopback connection, else its address."""
    (ip, port), (here, our_port) = conn.getpeername()[:2], conn.getsockname()[:2]
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
