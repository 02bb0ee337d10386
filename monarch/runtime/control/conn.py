"""The controller's records of its peers: one accepted connection (`Conn`; door.py lets it in and reads
it), one MPI job (`Job`: the processes of one proc mesh), and the sinks that take replies which are not a
caller's `CallState` (calls an actor made, telemetry batches).

The controller (controller.py) creates and drives them; they hold state, queue output and split frames.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from contextlib import suppress
from typing import Any

from monarch import config
from monarch.errors import SupervisionError
from monarch.runtime.control import codec
from monarch.runtime.control.commands import LAUNCHER, Call, Owner, Reply
from monarch.runtime.control.futures import CallState
from monarch.runtime.control.poller import Poller
from monarch.runtime.telemetry.events import RECORDER, error_text, now_us
from monarch.runtime.telemetry.store import STORE
from monarch.shape import Shape

log = logging.getLogger("monarch.controller")


class Conn:
    """One accepted socket: unauthenticated until its header checks out, then a worker or a monitor.

    Sending never blocks: what the socket does not take at once is queued, in order, and written by
    the poller when the peer reads, so a slow peer can never stall the control plane.
    """

    def __init__(self, sock: socket.socket, addr: int, poller: Poller) -> None:
        self.sock = sock
        self.addr = addr
        self.poller = poller
        self.lock = threading.Lock()
        self.out: deque[memoryview] = deque()
        self.head = b""
        self.header: codec.Header | None = None
        self.reader = codec.FrameReader(config.max_frame())
        self.mesh: Job | None = None  # the job of this worker or monitor, once authenticated
        self.opened = self.heard = time.monotonic()  # heard: when a heartbeat check last saw `fresh`
        self.fresh = False  # bytes came from the peer since the last heartbeat check
        self.excused_until = 0.0  # silence is no failure before this (the peer said it is Busy)

    def send(self, frame: bytes) -> None:
        with self.lock:
            if self.out:
                self.out.append(memoryview(frame))
                return
            try:
                n = self.sock.send(frame)
            except BlockingIOError:
                n = 0
            if n < len(frame):
                self.out.append(memoryview(frame)[n:])
                self.poller.want_write(self.sock.fileno(), self._flush)

    def _flush(self) -> None:
        """Write queued output while the socket takes it (poller thread)."""
        with self.lock:
            try:
                while self.out:
                    n = self.sock.send(self.out[0])
                    if n < len(self.out[0]):
                        self.out[0] = self.out[0][n:]
                        return
                    self.out.popleft()
            except BlockingIOError:
                return
            except OSError:
                self.out.clear()  # the peer is gone; its reader sees the EOF and reports it
            self.poller.done_writing(self.sock.fileno())


class ForwardSink:
    """Replies to a call an actor made: relayed to the calling worker's connection."""

    def __init__(self, source: Conn, call: Call, shape: Shape) -> None:
        self.source, self.call, self.missing = source, call, set(shape.ranks())

    @property
    def done(self) -> bool:
        return not self.missing

    def deliver(self, rank: int, ok: bool, payload: Any) -> None:
        if rank in self.missing:
            self.missing.discard(rank)
            value = payload if isinstance(payload, bytes) else codec.dumps(payload)
            frame = codec.encode_frame([Reply(self.call.call_id, self.call.reply_to, rank, ok, value)])
            limit = self.source.mesh.max_frame if self.source.mesh else config.max_frame()
            if not codec.fits(frame, limit):
                what = f"the reply of rank {rank} to {self.call.actor}.{self.call.endpoint}"
                err = codec.dumps(codec.too_large(what, frame, limit))
                frame = codec.encode_frame([Reply(self.call.call_id, self.call.reply_to, rank, False, err)])
            with suppress(OSError):  # the calling worker is gone; its own supervision reports that
                self.source.send(frame)

    def fail_missing(self, exc: BaseException) -> None:
        for r in sorted(self.missing):
            self.deliver(r, False, exc)


class TelemetrySink:
    """Replies to a ShipTelemetry: each rank's batch of events goes into the Store as it arrives, so a
    rank that answers after its caller stopped waiting loses nothing (a rank that fails brings none)."""

    what = "telemetry"

    def __init__(self, mesh: str, ranks: frozenset[int]) -> None:
        self.mesh, self.missing = mesh, ranks  # replaced, never mutated: other threads read it

    @property
    def done(self) -> bool:
        return not self.missing

    def deliver(self, rank: int, ok: bool, payload: Any) -> None:
        self.missing = self.missing - {rank}
        if ok:
            STORE.add(codec.loads(payload), self.mesh)

    def fail_missing(self, exc: BaseException) -> None:
        self.missing = frozenset()


_BANNER = re.compile(r"^(|=+|=   .*|YOUR APPLICATION TERMINATED .*|This typically refers to .*|Please see the FAQ .*)$")


def banner_free(text: str) -> str:
    """The launcher's output without MPICH's "BAD TERMINATION" banner, which it prints whenever a job ends
    by a signal (also a stop's SIGTERM): monarch reports failures itself, and telemetry keeps the lines."""
    if "=" not in text and "YOUR APPLICATION" not in text:
        return text
    return "".join(ln for ln in text.splitlines(keepends=True) if not _BANNER.match(ln.rstrip("\n")))


class Job:
    """Controller-side record of one MPI job (the processes of one proc mesh): its connections, pending calls
    and fate."""

    def __init__(self, mesh_id: int, name: str, shape: Shape, token: bytes, hosts: list[str]) -> None:
        self.id, self.name, self.shape, self.token = mesh_id, name, shape, token
        self.local = hosts == ["localhost"]
        per_host = len(shape) // len(hosts)
        self.hosts = [hosts[r // per_host] for r in range(len(shape))]  # as planned, then as each rank says
        self.conns: list[Conn | None] = [None] * len(shape)
        self.pids: list[int] = [0] * len(shape)
        self.monitors: list[int] = [0] * len(shape)  # each rank's monitor, the process the launcher started
        self.gpus: list[int] = [0] * len(shape)  # the GPUs each rank may use, as its Hello says
        self.device = "cpu"  # its tensors' device type, once every rank said hello
        self.pending: dict[tuple[int, int], CallState | ForwardSink | TelemetrySink] = {}
        self.actors: dict[str, Owner | None] = {}  # actor mesh name -> the actor that spawned it (None: the client)
        self.owner: Owner | None = None  # the actor that spawned this proc mesh (None: the client)
        self.proc: subprocess.Popen[bytes] | None = None
        self.kill_signal = signal.SIGKILL  # what the job gets when the mesh fails (the launcher's choice)
        self.leftovers: set[str] = set()  # files of this job's launcher that only a clean end removes
        self.settled = threading.Event()  # every worker said hello, or the mesh failed
        self.failure: SupervisionError | None = None
        self.unhandled: dict[str, SupervisionError] = {}  # actor mesh -> the fault its next call raises (supervision)
        self.stopping = False
        self.lost: dict[int, float] = {}  # rank -> deadline for its monitor's exit report
        self.stderr_tail: deque[str] = deque(maxlen=40)
        self.frames = 0  # frames sent to its workers (one per worker per flush or compiled step)
        self.heartbeat = config.heartbeat_timeout()  # seconds a worker may be silent (0: never fails)
        self.max_frame = config.max_frame()  # its workers inherit the flag: the largest frame they accept

    def host_of(self, rank: int) -> str:
        """The host of `rank` where the mesh spans hosts (else ""); for the launcher, its program."""
        if rank == LAUNCHER:
            return os.path.basename(self.proc.args[0]) if self.proc is not None else ""
        return "" if self.local or not 0 <= rank < len(self.hosts) else self.hosts[rank]

    def note_output(self, stream: str, text: str) -> None:
        """Keep the job's last stderr lines (for spawn errors and exit reports)."""
        if stream == "stderr":
            self.stderr_tail.extend(text.splitlines())

    def blamed(self) -> tuple[int, str] | None:
        """When the launcher ends while ranks are lost without an exit report (their monitor died with
        them: kill -9 of a monitor), the first of those ranks and why, else None."""
        if not self.lost:
            return None
        rank = min(self.lost, key=self.lost.__getitem__)
        return rank, (f"ended with its monitor, pid {self.monitors[rank]}, which sent no exit report (killed, "
                      "or its host went away)")

    def coords(self, rank: int) -> str:
        return self.shape.point(rank).label() if 0 <= rank < len(self.shape) else "?"

    @property
    def live(self) -> bool:
        return self.failure is None and not self.stopping

    def deliver(self, msg: Reply) -> None:
        """Hand a reply to the pending call it answers (recording a remote error as a failure)."""
        sink = self.pending.get((msg.reply_to, msg.call_id))
        if not msg.ok and RECORDER.on:
            RECORDER.add("failures", (msg.rank, self.name, "remote error", getattr(sink, "what", ""),
                                      error_text(codec.loads_error(msg.value)), now_us()))
        if sink is not None:
            sink.deliver(msg.rank, msg.ok, msg.value)
            if sink.done:
                self.pending.pop((msg.reply_to, msg.call_id), None)

    def fail_pending(self, err: BaseException) -> None:
        for sink in list(self.pending.values()):
            sink.fail_missing(err)
        self.pending.clear()

    def awaiting_telemetry(self) -> frozenset[int]:
        """Ranks that have not answered a request for their events yet."""
        sinks = [s for s in list(self.pending.values()) if type(s) is TelemetrySink]
        return frozenset().union(*(s.missing for s in sinks))
