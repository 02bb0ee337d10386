"""The worker process: decode control frames and dispatch them through `HANDLERS` to hosted actors.

Started as `python -m monarch.runtime.control.worker` by mpiexec (see bootstrap.py). One thread runs the
actors: it receives a chunk, runs every message in it in order, then sends all replies in one frame (the
sender's thread, heartbeat.py, beats and sends what an endpoint that runs on queued meanwhile). A call an
actor makes on another mesh is forwarded through the controller; while it waits, the worker keeps running
the messages of its other actors. Only an actor's own messages wait while it is mid-call (its
constructor included); each actor sees them in order. Threads that actors start may send too.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import select
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.actors import debugger
from monarch.runtime.actors.context import current_actor_name
from monarch.runtime.actors.hosting import HostedActor, Outcome
from monarch.runtime.control import codec
from monarch.runtime.control.client import set_client
from monarch.runtime.control.commands import (CONTROLLER, ActorFault, Busy, Call, DebugInput, Escalate, Forward,
                                              Heartbeat, InstallProgram, InvokeProgram, PortSend, Reply, RunProgram,
                                              ShipTelemetry, SpawnActor, Stop, Supervise)
from monarch.runtime.control.futures import CallState
from monarch.runtime.control.heartbeat import Sender
from monarch.runtime.control.spin import AdaptiveSpin
from monarch.runtime.telemetry.events import (BATCH, MEMORY_EVERY_S, RECORDER, Events, cuda_bytes, now_us,
                                              record_logging, rss_bytes)
from monarch.shape import Shape

IMPORT_GRACE_S = 120.0  # how long loading torch (it holds the GIL, so no heartbeat goes out) may take
BIG_FRAME = 64 << 20  # a frame this large is decoded under a Busy excuse (10 s per BIG_FRAME, at least 30 s)


class Worker:
    """The control-plane endpoint and actor host of one rank; also the client its actors send with."""
    threaded = False

    def __init__(self, sock: socket.socket, rank: int, mesh_id: int = 0) -> None:
        self.sock = sock
        self.rank = rank
        self.mesh_id = mesh_id
        self.loop = asyncio.new_event_loop()  # async endpoints run on it as tasks, stepped by serve()
        self._tasks: set[asyncio.Task] = set()
        self._ports: dict[int, Any] = {}  # channel receivers opened by this rank's actors
        self._max_frame = config.max_frame()  # the controller's limit too (the workers inherit the flag)
        self._reader = codec.FrameReader(self._max_frame)
        self._inbox: deque[Any] = deque()
        self._actors: dict[str, HostedActor] = {}
        self._pending: dict[int, CallState] = {}
        self.sender = Sender(sock, rank, self._max_frame, self._pending)  # every send goes through it
        self._outbox = self.sender.out
        self._main = threading.get_ident()  # the thread that runs the actors
        self._ids = itertools.count(1)
        self._stopped = False
        self._busy: set[str] = set()  # actors mid-call: their messages wait
        self._freed = 0  # async calls that ended (their actor's waiting messages may run)
        self._spin = AdaptiveSpin(config.spin_seconds())
        self._arrived: dict[int, int] = {}  # id(Call) -> when it arrived (µs), for the messages table
        self._ran: list[tuple[Call, int, int, bool]] = []  # calls run since the last flush: start, end, ok
        self._tensors: Any = None  # the tensor engine, created (with torch) on the first RunProgram
        self._torch_loaded = False  # torch is imported here (frames that mention it need no Busy)
        self._sampled = 0.0  # time.monotonic() of the last memory sample

    def serve(self) -> None:
        """Run until told to stop or until the controller goes away."""
        while not self._stopped:
            self._run_inbox()
            self._step()
            self.flush()
            if not self._stopped:
                self._pump(self._loop_timeout(None))

    def _step(self) -> None:
        """Run the event loop's ready callbacks (the async endpoints that can go on), unless the loop is
        already running (a blocking get() inside an async endpoint)."""
        if not self._tasks or self.loop.is_running():
            return
        for _ in range(64):
            self.loop.call_soon(self.loop.stop)
            self.loop.run_forever()
            if not self.loop._ready:  # noqa: SLF001 - asyncio has no public "anything ready?"
                return

    def _loop_timeout(self, timeout: float | None) -> float | None:
        """How long the socket may be waited on: not past the loop's next timer (asyncio.sleep), and not at
        all while a queued message can run (its actor's async call just ended)."""
        if self._inbox and any(not self._waits(m) for m in self._inbox):
            return 0.0
        if not self._tasks:
            return timeout
        if self.loop._ready:  # noqa: SLF001
            return 0.0
        timers = self.loop._scheduled  # noqa: SLF001 - a heap of TimerHandles
        if not timers:
            return timeout
        due = max(0.0, timers[0].when() - self.loop.time())
        return due if timeout is None else min(due, timeout)

    def _run_inbox(self) -> None:
        """Run queued messages in order, skipping (and keeping in place) those that wait for an actor mid-call.
        A handler that waits runs the queue itself; when an async call ended meanwhile, its actor's waiting
        messages come first."""
        i, freed = 0, self._freed
        while i < len(self._inbox) and not self._stopped:
            msg = self._inbox[i]
            if self._waits(msg):
                i += 1
                continue
            del self._inbox[i]
            HANDLERS[type(msg)](self, msg)
            if self._freed != freed:
                i, freed = 0, self._freed

    def _waits(self, msg: Any) -> bool:
        """Whether `msg` waits for an actor that is mid-call: its calls and supervision events do, and Stop
        waits for every call; port messages, spawns, tensor programs and the rest never wait."""
        if not self._busy:
            return False
        kind = type(msg)
        return msg.actor in self._busy if kind is Call or kind is Supervise else kind is Stop

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
        ready = timeout is None or select.select([self.sock], [], [], max(timeout, 0))[0]
        data = self.sock.recv(codec.RECV_BYTES) if ready else None
        self.sender.idle = False
        return data

    def _pump(self, timeout: float | None) -> None:
        data = self._recv(timeout)
        if data is None:
            return
        if not data:
            self._lost(TransportError(f"rank {self.rank}: the controller closed the control connection"))
            return
        arrived = now_us() if RECORDER.on else 0
        for body in self._reader.feed(data):
            try:
                msgs = self._decode(body)
            except Exception as e:  # noqa: BLE001 - drop one bad frame, keep serving
                print(f"monarch worker: dropped an undecodable frame: {e!r}", file=sys.stderr)
                continue
            for msg in msgs:
                if type(msg) is Reply:
                    self._reply(msg)
                elif type(msg) in HANDLERS:
                    if type(msg) is Call and arrived:
                        self._arrived[id(msg)] = arrived
                    self._inbox.append(msg)
                else:
                    print(f"monarch worker: dropped unknown message {type(msg).__name__}", file=sys.stderr)

    def _decode(self, body: bytes) -> list[Any]:
        """The frame's messages. The first frame that needs torch (a tensor program, a tensor argument) loads
        it while decoding, which holds the GIL for seconds on a loaded machine, and a very large frame (a big
        tensor argument) takes a while to unpickle: the controller is told first (Busy), so that the missing
        heartbeats meanwhile do not fail this worker."""
        importing = not self._torch_loaded and b"torch" in body and "torch" not in sys.modules
        self._torch_loaded = self._torch_loaded or "torch" in sys.modules
        if not importing and len(body) < BIG_FRAME:
            return codec.decode_frame(body)
        grace = IMPORT_GRACE_S if importing else max(30.0, len(body) / BIG_FRAME * 10.0)
        self.sender.sendall(codec.encode_frame([Busy(grace, "loading torch" if importing else "a large frame")]))
        try:
            return codec.decode_frame(body)
        finally:
            self.sender.sendall(codec.encode_frame([Busy(0.0, "")]))  # silence counts again
            self._torch_loaded = "torch" in sys.modules

    def _lost(self, err: Exception) -> None:
        self._stopped = True
        for state in self._pending.values():
            state.fail_missing(err)
        self._pending.clear()

    def flush(self) -> None:
        """Send what the handlers queued; then record the calls that ran (off the replies' path), and
        a memory sample when the last one is MEMORY_EVERY_S old."""
        if RECORDER.count >= BATCH:
            self._outbox.append(self._events())
        self.sender.flush()
        if self._ran:
            self._record_calls()
        if RECORDER.on and time.monotonic() >= self._sampled + MEMORY_EVERY_S:
            self._sample_memory()

    def _record_calls(self) -> None:
        for msg, start, end, ok in self._ran:
            RECORDER.add("messages", (self.rank, msg.actor, msg.endpoint, msg.sender or "controller", len(msg.args),
                                      self._arrived.pop(id(msg), start), start, end, "ok" if ok else "error"))
        self._ran.clear()

    # -- handlers --------------------------------------------------------------------------------
    def _spawn(self, msg: SpawnActor) -> None:
        self._busy.add(msg.name)  # calls that come while __init__ waits (a nested call or spawn) wait for it
        try:
            actor = self._actors[msg.name] = HostedActor(msg, self.rank, self.mesh_id)
        finally:
            self._busy.discard(msg.name)
        if actor.fault is not None:
            self._report(msg.name, actor.fault)

    def _report(self, name: str, outcome: Outcome) -> None:
        """Actor `name` failed and stopped: its owner is told through the controller."""
        print(f"monarch: actor {name!r} on rank {self.rank} {outcome.fault}\n{outcome.detail}", file=sys.stderr)
        self._outbox.append(ActorFault(name, outcome.fault, outcome.detail))

    def _call(self, msg: Call) -> None:
        actor = self._actors.get(msg.actor)
        start = now_us()
        if actor is None:
            self._finish(msg, start, Outcome(False, codec.dumps(TransportError(
                f"rank {self.rank} hosts no actor {msg.actor!r}"))))
            return
        self._busy.add(msg.actor)
        try:
            out = actor.call(msg)
        finally:
            self._busy.discard(msg.actor)
        if inspect.iscoroutine(out):
            self._start(msg, start, out, actor.endpoints[msg.endpoint].concurrent)
        else:
            self._finish(msg, start, out)

    def _start(self, msg: Call, start: int, coro: Any, concurrent: bool) -> None:
        """An async endpoint as a task: the actor takes no other message until it ends, unless concurrent."""
        if not concurrent:
            self._busy.add(msg.actor)
        task = self.loop.create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not concurrent:
                self._busy.discard(msg.actor)
                self._freed += 1
            self._finish(msg, start, t.result())
        task.add_done_callback(done)

    def _finish(self, msg: Call, start: int, out: Outcome) -> None:
        if RECORDER.on:
            self._ran.append((msg, start, now_us(), out.ok))
        elif self._arrived:  # recording was switched off while this call waited
            self._arrived.pop(id(msg), None)
        if out.value is not None:
            if msg.port is not None:
                self.send_port(PortSend(msg.port if msg.port.rank is not None else
                                        replace(msg.port, rank=self.rank), out.ok, out.value))
            elif msg.want_reply:
                self._outbox.append(Reply(msg.call_id, msg.reply_to, self.rank, out.ok, out.value))
        if out.fault:
            self._report(msg.actor, out)

    def _reply(self, msg: Reply) -> None:
        state = self._pending.get(msg.call_id)
        if state is not None:
            state.deliver(msg.rank, msg.ok, msg.value)
            if state.done:
                del self._pending[msg.call_id]

    def _install(self, msg: InstallProgram) -> None:
        self._tensor_service().install(msg)

    def _invoke(self, msg: InvokeProgram) -> None:
        self._tensor_service().invoke(msg)

    def _tensor_service(self) -> Any:
        if self._tensors is None:
            from monarch.runtime.engine.service import TensorService
            self._tensors = TensorService(self.rank)
        return self._tensors

    def _run_program(self, msg: RunProgram) -> None:
        reply = self._tensor_service().run(msg)
        if msg.call_id:
            ok, value = reply
            self._outbox.append(Reply(msg.call_id, CONTROLLER, self.rank, ok, value))

    def _ship_telemetry(self, msg: ShipTelemetry) -> None:
        self._outbox.append(Reply(msg.call_id, CONTROLLER, self.rank, True, codec.dumps_data(self._events())))

    def _events(self) -> Events:
        """This worker's pending events, with a memory sample."""
        self._record_calls()
        self._sample_memory()
        return RECORDER.take()

    def _sample_memory(self) -> None:
        store = self._tensors.engine.store if self._tensors is not None else {}
        tensors = [v for v in store.values() if hasattr(v, "nbytes")]
        RECORDER.add("memory", (self.rank, rss_bytes(), sum(t.nbytes for t in tensors), len(tensors), *cuda_bytes(),
                                now_us()))
        self._sampled = time.monotonic()

    def _heartbeat(self, msg: Heartbeat) -> None:
        self.sender.beat(msg.every)

    def _stop(self, msg: Stop) -> None:
        self._stopped = True

    def _supervise(self, msg: Supervise) -> None:
        """The owner's __supervise__ gets the failure; unhandled, it goes on up (Escalate)."""
        actor = self._actors.get(msg.actor)
        handled = actor.supervise(msg.failure) if actor is not None else False
        if inspect.iscoroutine(handled):
            task = self.loop.create_task(handled)
            self._tasks.add(task)

            def done(t: asyncio.Task) -> None:
                self._tasks.discard(t)
                self._supervised(msg, actor, t.result())
            task.add_done_callback(done)
            return
        self._supervised(msg, actor, bool(handled))

    def _supervised(self, msg: Supervise, actor: HostedActor | None, handled: bool) -> None:
        if not handled:
            raised = actor.fault.detail if actor is not None and actor.fault is not None else ""
            self._outbox.append(Escalate(msg.failure, msg.actor, raised))

    def _port_send(self, msg: PortSend) -> None:
        inbox = self._ports.get(msg.ref.port)
        if inbox is not None:
            inbox.put(msg.ok, msg.value, msg.ref.rank)

    def take_queued(self, kind: type, timeout: float) -> tuple[list[Any], bool]:
        """For a rank paused in pdb (actors/debugger.py), whose loop waits: send what is queued, wait up to
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
    def next_call_id(self) -> int:
        return next(self._ids)

    def port_owner(self) -> tuple[int, int]:
        return (self.mesh_id, self.rank)

    def open_port(self, port: int, inbox: Any) -> None:
        self._ports[port] = inbox

    def send_port(self, msg: PortSend) -> None:
        """To a receiver of this rank directly from the actors' thread; else through the controller (whose
        answer wakes the actors' thread for what other threads send)."""
        here = msg.ref.owner == (self.mesh_id, self.rank) and msg.ref.reply is None
        if here and threading.get_ident() == self._main:
            self._port_send(msg)
        else:
            self._post(msg)

    def _post(self, msg: Any) -> None:
        """Queue `msg`; from a thread an actor started, send it now (the actors' thread flushes its own)."""
        self._outbox.append(msg)
        if threading.get_ident() != self._main:
            self.sender.flush()

    def send(self, mesh_id: int, shape: Shape, call: Call, state: CallState | None) -> None:
        if state is not None:
            self._pending[call.call_id] = state
        self._post(Forward(mesh_id, shape, call))
        if state is None:
            return
        if self._stopped:
            self._lost(TransportError(f"rank {self.rank}: the control connection is closed"))

    def ask(self, op: Any, state: CallState) -> None:
        """Send a mesh request (actors/requests.py) to the controller for the running actor (it owns what the
        request makes); its Reply settles `state`."""
        self._pending[op.call_id] = state
        self._post(replace(op, actor=current_actor_name()))

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        """Run messages until `arrived` replies of `state` came; a thread an actor started blocks instead
        (the actors' thread delivers)."""
        if threading.get_ident() != self._main:
            state.wait(arrived, None if deadline is None else deadline - time.monotonic())
            return
        while len(state.arrived) < arrived and not self._stopped:
            self._run_inbox()
            self._step()
            self.flush()
            if len(state.arrived) >= arrived:
                return
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return
            self._pump(self._loop_timeout(timeout))


HANDLERS: dict[type, Callable[[Worker, Any], None]] = {  # by message type (Reply is run as it arrives)
    SpawnActor: Worker._spawn, Call: Worker._call, Reply: Worker._reply, Stop: Worker._stop,
    Supervise: Worker._supervise, Heartbeat: Worker._heartbeat, ShipTelemetry: Worker._ship_telemetry,
    RunProgram: Worker._run_program, InstallProgram: Worker._install, InvokeProgram: Worker._invoke,
    DebugInput: debugger.stale_input, PortSend: Worker._port_send}


def main(argv: list[str]) -> int:
    from monarch.runtime.control import bootstrap
    boot = bootstrap.start(argv)
    worker = Worker(boot.sock, boot.rank, boot.mesh_id)
    record_logging(boot.rank)
    set_client(worker)
    debugger.install()
    worker.serve()
    worker.flush()
    worker.sender.close()
    boot.sock.close()
    return 0


if __name__ == "__main__":
    from monarch.runtime.control.bootstrap import leave
    leave(main(sys.argv[1:]))
