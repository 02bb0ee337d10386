"""Heartbeats: a worker process that is alive but silent (stopped, hung, cut off) fails its mesh.

Worker side, `Sender`: every send of a worker goes through its lock (frames never interleave), and a
daemon thread sends an empty frame whenever nothing was sent for a while; it needs nothing from the
main thread, so it beats while an endpoint or a kernel runs. Controller side, `Watch`: fails a worker
silent for its mesh's timeout, counting only time during which the controller itself was polling, and
not while the worker said it is `Busy` (loading torch's libraries holds the GIL, which stops the beats).
Neither end reads a clock per message: a send or a read only sets a flag that the timers look at.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from monarch.runtime.control import codec

BEAT = codec.encode_frame([])  # a frame of no messages: the controller only notes that bytes came
CHECK_S = 0.1  # how often the controller looks for silent workers while a mesh has heartbeats on
IDLE_S = 1.0  # how often it looks while none has
LATE_S = 0.2  # a check this late means nothing polled for that long: the controller itself was paused


def interval(timeout: float) -> float:
    """How often a worker beats for a mesh whose timeout is `timeout` (five beats per timeout)."""
    return timeout / 5


class Sender:
    """A worker's sends, under one lock; `beat(every)` starts the heartbeat thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._sent = False  # a frame went out since the heartbeat thread last looked
        self._lock = threading.Lock()
        self._every = 0.0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def sendall(self, frame: bytes) -> None:
        self._lock.acquire()  # not `with`: this is on every reply's path, and half the cost
        try:
            self.sock.sendall(frame)
            self._sent = True
        finally:
            self._lock.release()

    def beat(self, every: float) -> None:
        """Send a heartbeat every `every` seconds in which nothing else was sent (0: stop beating); a
        healthy worker is never silent for more than twice that."""
        self._every = every
        if every > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="monarch-heartbeat", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop beating; after this nothing more is sent."""
        self._closed.set()
        with self._lock:
            self._every = 0.0

    def _run(self) -> None:
        while not self._closed.wait(self._every or IDLE_S):
            with self._lock:
                if self._every and not self._sent:
                    try:
                        self.sock.sendall(BEAT)
                    except OSError:
                        return  # the connection is gone; the main thread sees it and exits
                self._sent = False


Fail = Callable[[Any, int, int, str], None]  # (mesh, rank, pid, status): Controller._fail


class Watch:
    """The controller's check for silent workers, run from its timers on every poll.

    Silence is measured from the later of the last bytes received and the moment the controller
    resumed polling after a pause (its process stopped, a call holding the GIL, an overloaded
    machine): what a worker sent during the pause is still unread, so a slow controller never fails
    a worker. The poller wakes for every check, so a check that comes late marks such a pause.
    """

    def __init__(self) -> None:
        self._resumed = self._next = 0.0
        self._watching = False

    def tick(self, now: float, meshes: dict[int, Any], fail: Fail) -> float:
        """Fail the silent workers of `meshes` when a check is due; seconds until the next one."""
        if now < self._next:
            return self._next - now
        if now - self._next > LATE_S or not self._watching:
            self._resumed = now  # silence counts from here: what came during the pause is unread
        watched = [m for m in list(meshes.values()) if m.live and m.heartbeat > 0]
        for mesh in watched:
            self._check(mesh, now, fail)
        self._watching = bool(watched)
        self._next = now + (CHECK_S if watched else IDLE_S)
        return self._next - now

    def _check(self, mesh: Any, now: float, fail: Fail) -> None:
        for rank, conn in enumerate(mesh.conns):
            if conn is None or not mesh.pids[rank] or rank in mesh.lost:
                continue  # not said hello yet (spawn's own timeout applies), or already lost
            if conn.fresh:
                conn.fresh, conn.heard = False, now
            silent = now - max(conn.heard, self._resumed)
            if silent > mesh.heartbeat and now >= conn.excused_until:
                fail(mesh, rank, mesh.pids[rank],
                     f"no heartbeat for {silent:.1f} s (MONARCH_HEARTBEAT_TIMEOUT={mesh.heartbeat:g}): the "
                     "process is stopped, stuck in code that holds the GIL, or cut off from the controller")
                return
