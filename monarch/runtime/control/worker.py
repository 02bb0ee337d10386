"""A worker's frame loop: read control frames, run their messages in order through the handler table that
the worker entry (monarch/runtime/worker.py) builds, send the replies; and the client its actors send with.

One thread runs the actors: it receives a chunk, runs every message in it in order, then sends all replies in
one frame (the sender's thread, heartbeat.py, beats and sends what an endpoint that runs on queued meanwhile).
A call an actor makes on another mesh is forwarded through the controller; while it waits, the loop keeps
running the other messages. Which messages wait for an actor mid-call, and the async endpoints, are the
actor host's (`Host`, monarch/runtime/actors/host.py). Threads that actors start may send too.
"""
from __future__ import annotations

import asyncio
import itertools
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.control import codec
from monarch.runtime.control.client import Inbox
from monarch.runtime.control.commands import (CONTROLLER, Busy, Call, Forward, Heartbeat, MeshRequest, PortSend,
                                              Reply, ShipTelemetry, Stop)
from monarch.runtime.control.futures import CallState
from monarch.runtime.control.heartbeat import Sender
from monarch.runtime.control.poller import AdaptiveSpin
from monarch.runtime.telemetry.events import Collector, imported
from monarch.shape import Shape

IMPORT_GRACE_S = 120.0  # how long loading torch (it holds the GIL, so no heartbeat goes out) may take
BIG_FRAME = 64 << 20  # a frame this large is decoded under a Busy excuse (10 s per BIG_FRAME, at least 30 s)
Handlers = dict[type, Callable[[Any], None]]  # by message type; Reply is run as it arrives, not queued


class Host(Protocol):
    """What the frame loop needs of the actors it runs messages for (actors/host.py's ActorHost)."""
    freed: int  # async calls that ended so far (their actor's waiting messages may run now)
    loop: asyncio.AbstractEventLoop  # the async endpoints' event loop

    def waits(self, msg: Any) -> bool:
        """Whether `msg` waits for an actor that is mid-call."""

    def step(self) -> None:
        """Run the async endpoints that can go on."""

    def due(self) -> float | None:
        """Seconds until an async endpoint can go on (0: now; None: none waits for a timer)."""

    def actor_name(self) -> str:
        """The running actor's name ("client" outside actors)."""

    def open_port(self, port: int, inbox: Inbox) -> None: ...

    def deliver(self, msg: PortSend) -> None:
        """Put a port's message into its receiver on this rank."""


class Worker:
    """The control-plane endpoint of one rank, and the client its actors send with. `serve` runs it with the
    actor host, the telemetry collector and the handler table the worker entry wires."""
    threaded = False
    is_controller = False
    host: Host
    telemetry: Collector

    def __init__(self, sock: socket.socket, rank: int, mesh_id: int = 0) -> None:
        self.sock = sock
        self.rank = rank
        self.mesh_id = mesh_id
        self.handlers: Handlers = {}
        self._max_frame = config.max_frame()  # the controller's limit too (the workers inherit the flag)
        self._reader = codec.FrameReader(self._max_frame)
        self._inbox: deque[Any] = deque()
        self._pending: dict[int, CallState] = {}
        self.sender = Sender(sock, rank, self._max_frame, self._pending)  # every send goes through it
        self._outbox = self.sender.out
        self._main = threading.get_ident()  # the thread that runs the actors
        self._ids = itertools.count(1)
        self._stopped = False
        self._spin = AdaptiveSpin(config.spin_seconds())
        self._torch_loaded = False  # torch is imported here (frames that mention it need no Busy)

    def serve(self, host: Host, telemetry: Collector, handlers: Handlers) -> None:
        """Run until told to stop or until the controller goes away."""
        self.host, self.telemetry, self.handlers = host, telemetry, handlers
        while not self._stopped:
            self._run_inbox()
            host.step()
            self.flush()
            if not self._stopped:
                self._pump(self._timeout(None))

    def _timeout(self, timeout: float | None) -> float | None:
        """How long the socket may be waited on: not past the host's next timer (asyncio.sleep), and not at
        all while a queued message can run (its actor's async call just ended)."""
        if self._inbox and any(not self.host.waits(m) for m in self._inbox):
            return 0.0
        due = self.host.due()
        if due is None:
            return timeout
        return due if timeout is None else min(due, timeout)

    def _run_inbox(self) -> None:
        """Run queued messages in order, skipping (and keeping in place) those that wait for an actor mid-call.
        A handler that waits runs the queue itself; when an async call ended meanwhile, its actor's waiting
        messages come first."""
        i, freed = 0, self.host.freed
        while i < len(self._inbox) and not self._stopped:
            msg = self._inbox[i]
            if self.host.waits(msg):
                i += 1
                continue
            del self._inbox[i]
            self.handlers[type(msg)](msg)
            if self.host.freed != freed:
                i, freed = 0, self.host.freed

    def _recv(self, timeout: float | None) -> bytes | None:
        """Busy-poll briefly (the next message usually follows at once), then block up to `timeout`."""
        budget = self._spin.budget()
        until = time.perf_counter() + budget
        while budget:
            try:
                data = self.sock.recv(codec.RECV_BYTES, socket.MSG_DONTWAIT)
                self._spin.hit()
                return data
            except BlockingIOError:
                if time.perf_counter() >= until:
                    self._spin.miss()
                    break
        self.sender.idle = True  # its thread waits for the socket too
        try:
            if timeout is not None and not select.select([self.sock], [], [], max(timeout, 0))[0]:
                return None
            return self.sock.recv(codec.RECV_BYTES)
        finally:
            self.sender.idle = False

    def _pump(self, timeout: float | None) -> None:
        data = self._recv(timeout)
        if data is None:
            return
        if not data:
            self._lost(TransportError(f"rank {self.rank}: the controller closed the control connection"))
            return
        arrived = self.telemetry.now()
        for body in self._reader.feed(data):
            try:
                msgs = self._decode(body)
            except Exception as e:  # noqa: BLE001 - drop one bad frame, keep serving
                print(f"monarch worker: dropped an undecodable frame: {e!r}", file=sys.stderr)
                continue
            for msg in msgs:
                if type(msg) is Reply:
                    self.reply(msg)
                elif type(msg) in self.handlers:
                    if type(msg) is Call and arrived:
                        self.telemetry.arrived(msg, arrived)
                    self._inbox.append(msg)
                else:
                    print(f"monarch worker: dropped unknown message {type(msg).__name__}", file=sys.stderr)

    def _decode(self, body: bytes) -> list[Any]:
        """The frame's messages. The first frame that needs torch (a tensor program, a tensor argument) loads
        it while decoding, which holds the GIL for seconds on a loaded machine, and a very large frame (a big
        tensor argument) takes a while to unpickle: the controller is told first (Busy), so that the missing
        heartbeats meanwhile do not fail this worker."""
        importing = not self._torch_loaded and b"torch" in body and imported("torch") is None
        self._torch_loaded = self._torch_loaded or imported("torch") is not None
        if not importing and len(body) < BIG_FRAME:
            return codec.decode_frame(body)
        grace = IMPORT_GRACE_S if importing else max(30.0, len(body) / BIG_FRAME * 10.0)
        try:
            with self.busy(grace, "loading torch" if importing else "a large frame"):
                return codec.decode_frame(body)
        finally:
            self._torch_loaded = imported("torch") is not None

    @contextmanager
    def busy(self, seconds: float, why: str) -> Iterator[None]:
        """Run the block with the controller told to excuse this worker's silence for up to `seconds` (a block
        that holds the GIL for long stretches keeps heartbeats from going out)."""
        self.sender.sendall(codec.encode_frame([Busy(seconds, why)]))
        try:
            yield
        finally:
            self.sender.sendall(codec.encode_frame([Busy(0.0, "")]))  # silence counts again

    def _lost(self, err: Exception) -> None:
        self._stopped = True
        for state in self._pending.values():
            state.fail_missing(err)
        self._pending.clear()

    def flush(self) -> None:
        """Send what the handlers queued (with a batch of events once there are many); then the telemetry
        bookkeeping, off the replies' path."""
        batch = self.telemetry.batch()
        if batch is not None:
            self._outbox.append(batch)
        self.sender.flush()
        self.telemetry.flushed()

    # -- handlers --------------------------------------------------------------------------------
    def reply(self, msg: Reply) -> None:
        state = self._pending.get(msg.call_id)
        if state is not None:
            state.deliver(msg.rank, msg.ok, msg.value)
            if state.done:
                del self._pending[msg.call_id]

    def stop(self, msg: Stop) -> None:
        self._stopped = True

    def heartbeat(self, msg: Heartbeat) -> None:
        self.sender.beat(msg.every)

    def ship_telemetry(self, msg: ShipTelemetry) -> None:
        self.answer(msg.call_id, True, codec.dumps_data(self.telemetry.events()))

    def answer(self, call_id: int, ok: bool, value: bytes) -> None:
        """Queue this rank's answer to the controller's call `call_id`."""
        self._outbox.append(Reply(call_id, CONTROLLER, self.rank, ok, value))

    def post(self, msg: Any) -> None:
        """Queue `msg`; from a thread an actor started, send it now (the actors' thread flushes its own)."""
        self._outbox.append(msg)
        if threading.get_ident() != self._main:
            self.sender.flush()

    def take_queued(self, kind: type, timeout: float) -> tuple[list[Any], bool]:
        """For a rank paused in pdb (debug/relay.py), whose loop waits: send what is queued, wait up to
        `timeout` for messages of `kind` and take them out of the queue (the rest stay, in order); and whether
        the worker must stop (a Stop is queued, or the controller went away)."""
        self.flush()
        if not any(type(m) is kind for m in self._inbox) and not self._stopped:
            self._pump(timeout)
        taken = [m for m in self._inbox if type(m) is kind]
        if taken:
            rest = [m for m in self._inbox if type(m) is not kind]
            self._inbox.clear()
            self._inbox.extend(rest)
        return taken, self._stopped or any(type(m) is Stop for m in self._inbox)

    # -- client protocol: calls that actors make on other meshes ---------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The actors' event loop: a Future awaited in an async endpoint is settled on it (futures.py)."""
        return self.host.loop

    def next_call_id(self) -> int:
        return next(self._ids)

    def port_owner(self) -> tuple[int, int]:
        return (self.mesh_id, self.rank)

    def reach_host(self) -> str:
        return str(self.sock.getsockname()[0])

    def open_port(self, port: int, inbox: Inbox) -> None:
        self.host.open_port(port, inbox)

    def send_port(self, msg: PortSend) -> None:
        """To a receiver of this rank directly from the actors' thread; else through the controller (whose
        answer wakes the actors' thread for what other threads send)."""
        here = msg.ref.owner == (self.mesh_id, self.rank) and msg.ref.reply is None
        if here and threading.get_ident() == self._main:
            self.host.deliver(msg)
        else:
            self.post(msg)

    def send(self, mesh_id: int, shape: Shape, call: Call, state: CallState | None) -> None:
        if state is not None:
            self._pending[call.call_id] = state
        self.post(Forward(mesh_id, shape, call))
        if state is None:
            return
        if self._stopped:
            self._lost(TransportError(f"rank {self.rank}: the control connection is closed"))

    def ask(self, op: MeshRequest, state: CallState) -> None:
        """Send a mesh request (control/handlers/requests.py) to the controller for the running actor (it owns what the
        request makes); its Reply settles `state`."""
        self._pending[op.call_id] = state
        self.post(replace(op, actor=self.host.actor_name()))

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        """Run messages until `arrived` replies of `state` came; a thread an actor started blocks instead
        (the actors' thread delivers)."""
        if threading.get_ident() != self._main:
            state.wait(arrived, None if deadline is None else deadline - time.monotonic())
            return
        while len(state.arrived) < arrived and not self._stopped:
            self._run_inbox()
            self.host.step()
            self.flush()
            if len(state.arrived) >= arrived:
                return
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return
            self._pump(self._timeout(timeout))
