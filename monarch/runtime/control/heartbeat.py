"""Heartbeats, and a worker's sends: a worker process that is alive but silent (stopped, hung, cut off)
fails its mesh; what a worker sends never waits behind an endpoint that runs on.

Worker side, `Sender`: every send of a worker goes through its lock (frames never interleave); queued
messages go out in one frame per flush, and a daemon thread sends an empty frame whenever nothing was
sent for a while and flushes what the main thread left queued while it runs an endpoint (it needs
nothing from the main thread, so it beats and delivers while an endpoint or a kernel runs). Controller
side, `Watch`: fails a worker silent for its mesh's timeout, counting only time during which the
controller itself was polling, and not while the worker said it is `Busy` (loading torch's libraries
holds the GIL, which stops the beats). Neither end reads a clock per message: a send or a read only
sets a flag or a counter that the timers look at.
"""
from __future__ import annotations

import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch.runtime.control import codec
from monarch.runtime.control.commands import Forward, Reply

if TYPE_CHECKING:
    from monarch.runtime.control.conn import Job

BEAT = codec.encode_frame([])  # a frame of no messages: the controller only notes that bytes came
CHECK_S = 0.1  # how often the controller looks for silent workers while a mesh has heartbeats on
IDLE_S = 1.0  # how often it looks while none has
LATE_S = 0.2  # a check this late means nothing polled for that long: the controller itself was paused
LINGER_S = 0.01  # what a worker's main thread leaves queued this long (an endpoint still runs) goes out anyway


def interval(timeout: float) -> float:
    """How often a worker beats for a mesh whose timeout is `timeout` (five beats per timeout)."""
    return timeout / 5


class Sender:
    """The sends of worker `rank`, under one lock. `out` is the queue of messages (any thread appends);
    `flush` sends them in one frame; a daemon thread beats (`beat(every)`) and flushes what the main thread
    left queued for LINGER_S without flushing (it is running an endpoint, perhaps stuck in it). `pending`:
    the worker's calls waiting for replies (one whose message is refused fails)."""

    def __init__(self, sock: socket.socket, rank: int, max_frame: int, pending: dict[int, Any]) -> None:
        self.sock = sock
        self.out: deque[Any] = deque()
        self.idle = False  # set by the main thread while it waits for the socket, with nothing queued
        self.flushes = 0
        self._rank, self._max_frame, self._pending = rank, max_frame, pending
        self._sent = False  # a frame went out since the heartbeat last looked
        self._lock = threading.Lock()
        self._every = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="monarch-sender", daemon=True).start()

    def sendall(self, frame: bytes) -> None:
        self._lock.acquire()  # not `with`: this is on every reply's path, and half the cost
        try:
            self.sock.sendall(frame)
            self._sent = True
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Send what is queued, in order, in one frame."""
        self.flushes += 1
        if not self.out:
            return
        self._lock.acquire()
        try:
            n = len(self.out)  # other threads may append meanwhile: they go with the next flush
            if n:
                msgs = [self.out.popleft() for _ in range(n)]
                self.sock.sendall(codec.encode_frames(msgs, self._max_frame, self._refuse))
                self._sent = True
        finally:
            self._lock.release()

    def _refuse(self, msg: Any, frame: bytes) -> Any:
        """What goes instead of a message over MONARCH_MAX_FRAME: a reply becomes the error; a forwarded call or
        a mesh request fails here (the calling actor's get() raises it); telemetry events are dropped."""
        kind = type(msg)
        what = (f"a call of {msg.call.actor}.{msg.call.endpoint} from rank {self._rank}" if kind is Forward
                else f"the {'reply' if kind is Reply else kind.__name__} of rank {self._rank}")
        err = codec.too_large(what, frame, self._max_frame)
        if kind is Reply:
            return Reply(msg.call_id, msg.reply_to, msg.rank, False, codec.dumps(err))
        call_id = msg.call.call_id if kind is Forward else getattr(msg, "call_id", 0)  # a call, or a mesh request
        state = self._pending.pop(call_id, None)
        if state is not None:
            state.fail_missing(err)
        else:
            print(f"monarch worker: dropped {err}", file=sys.stderr)
        return None

    def beat(self, every: float) -> None:
        """Send a heartbeat every `every` seconds in which nothing else was sent (0: stop beating); a
        healthy worker is never silent for more than twice that."""
        self._every = every

    def close(self) -> None:
        """Stop beating; after this nothing more is sent."""
        self._closed.set()
        with self._lock:
            self._every = 0.0

    def _run(self) -> None:
        seen, checked = -1, time.monotonic()
        try:
            while not self._closed.is_set():
                woke = self._nap(checked + (self._every or IDLE_S) - time.monotonic())
                if self.out and self.flushes == seen and not self._closed.is_set():
                    self.flush()
                seen = self.flushes
                if time.monotonic() >= checked + (self._every or IDLE_S):
                    self._beat()
                    checked = time.monotonic()
                if woke:
                    self._closed.wait(LINGER_S)  # the main thread reads what came: do not select again at once
        except OSError:
            return  # the connection is gone; the main thread sees it and exits

    def _nap(self, until_beat: float) -> bool:
        """Wait LINGER_S while the main thread works; while it waits for the socket too, until bytes come
        (it works again: whether they did) or a beat is due."""
        if self.idle and not self.out:
            try:
                return bool(select.select([self.sock], [], [], max(until_beat, 0.0))[0])
            except ValueError:  # the socket was closed
                return False
        self._closed.wait(LINGER_S)
        return False

    def _beat(self) -> None:
        with self._lock:
            if self._every and not self._sent and not self._closed.is_set():
                self.sock.sendall(BEAT)
            self._sent = False


Fail = Callable[["Job", int, int, str], None]  # (job, rank, pid, status): Controller.fail


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

    def tick(self, now: float, meshes: dict[int, Job], fail: Fail) -> float:
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

    def _check(self, mesh: Job, now: float, fail: Fail) -> None:
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
