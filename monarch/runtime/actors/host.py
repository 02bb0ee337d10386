"""The actors of one worker: spawn them, run their calls (async endpoints as tasks on an event loop that the
frame loop steps), report their faults, hand them supervision events, and deliver to the ports they opened.

Only an actor's own messages wait while it is mid-call (its constructor included); each actor sees them in
order. `ActorHost` is the frame loop's `Host` (control/worker.py); the worker entry puts its handlers in the
worker's handler table.
"""
from __future__ import annotations

import asyncio
import selectors
import sys
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from monarch.errors import TransportError
from monarch.runtime.actors.context import current_actor_name
from monarch.runtime.actors.hosting import HostedActor, Outcome
from monarch.runtime.control import codec
from monarch.runtime.control.client import Inbox
from monarch.runtime.control.commands import ActorFault, Call, Escalate, PortSend, Reply, SpawnActor, Stop, Supervise
from monarch.runtime.control.worker import Worker
from monarch.runtime.telemetry.events import Collector, now_us

STEPS = 64  # rounds of ready callbacks one step runs at most, so that messages are not kept waiting


class Stepper(selectors.DefaultSelector):
    """The event loop's selector, polled but never waited on: `select` notes when the loop has work next
    (`when`, on the loop's clock; None: no timer) and ends the step (loop.stop(): the round under way is
    its last) once nothing is ready, or after STEPS rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.when: float | None = None
        self.rounds = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        idle = not events and timeout != 0  # no callback is ready (0: some are, or a timer is due)
        now = time.monotonic()  # the loop's clock (BaseEventLoop.time)
        self.when = now if not idle else None if timeout is None else now + timeout
        self.rounds -= 1
        if idle or self.rounds <= 0:
            assert self.loop is not None, "the Stepper's loop is set when the loop is made"
            self.loop.stop()
        return events


class ActorHost:
    """The hosted actors of `worker`'s rank, the set of those mid-call (their messages wait), the tasks of
    their async endpoints, and the receivers of the ports they opened."""

    def __init__(self, worker: Worker, telemetry: Collector) -> None:
        self.worker = worker
        self.rank, self.mesh_id = worker.rank, worker.mesh_id
        self.telemetry = telemetry
        self.freed = 0  # async calls that ended (their actor's waiting messages may run)
        self._actors: dict[str, HostedActor] = {}
        self._busy: set[str] = set()  # actors mid-call: their messages wait
        self._tasks: set[asyncio.Task] = set()
        self._ports: dict[int, Inbox] = {}  # channel receivers opened by this rank's actors
        self._selector = Stepper()
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(self._selector)  # async endpoints' tasks
        self._selector.loop = self.loop

    # -- what the frame loop asks (control.worker.Host) ------------------------------------------
    def waits(self, msg: Any) -> bool:
        """Whether `msg` waits for an actor that is mid-call: its calls and supervision events do, and Stop
        waits for every call; port messages, spawns, tensor programs and the rest never wait."""
        if not self._busy:
            return False
        kind = type(msg)
        return msg.actor in self._busy if kind is Call or kind is Supervise else kind is Stop

    def step(self) -> None:
        """Run the event loop's ready callbacks (the async endpoints that can go on), unless the loop is
        already running (a blocking get() inside an async endpoint)."""
        if not self._tasks or self.loop.is_running():
            return
        self._selector.rounds = STEPS
        self.loop.run_forever()

    def due(self) -> float | None:
        """Seconds until the event loop has work (0: now; None: no task waits for a timer)."""
        when = self._selector.when if self._tasks else None
        return None if when is None else max(0.0, when - time.monotonic())

    def actor_name(self) -> str:
        return current_actor_name()

    def open_port(self, port: int, inbox: Inbox) -> None:
        self._ports[port] = inbox

    def deliver(self, msg: PortSend) -> None:
        inbox = self._ports.get(msg.ref.port)
        if inbox is not None:
            inbox.put(msg.ok, msg.value, msg.ref.rank)

    # -- handlers --------------------------------------------------------------------------------
    def spawn(self, msg: SpawnActor) -> None:
        self._busy.add(msg.name)  # calls that come while __init__ waits (a nested call or spawn) wait for it
        try:
            actor = self._actors[msg.name] = HostedActor(msg, self.rank, self.mesh_id)
        finally:
            self._busy.discard(msg.name)
        if actor.fault is not None:
            self._report(msg.name, actor.fault)

    def call(self, msg: Call) -> None:
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
        if isinstance(out, Outcome):
            self._finish(msg, start, out)
        else:
            self._start(msg, start, out, actor.endpoints[msg.endpoint].concurrent)

    def supervise(self, msg: Supervise) -> None:
        """The owner's __supervise__ gets the failure; unhandled, it goes on up (Escalate)."""
        actor = self._actors.get(msg.actor)
        handled = actor.supervise(msg.failure) if actor is not None else False
        if isinstance(handled, bool):
            self._supervised(msg, actor, handled)
        else:
            self._task(handled).add_done_callback(lambda t: self._supervised(msg, actor, t.result()))

    # -- the rest --------------------------------------------------------------------------------
    def _task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start(self, msg: Call, start: int, coro: Coroutine[Any, Any, Outcome], concurrent: bool) -> None:
        """An async endpoint as a task: the actor takes no other message until it ends, unless concurrent."""
        if not concurrent:
            self._busy.add(msg.actor)

        def done(t: asyncio.Task) -> None:
            if not concurrent:
                self._busy.discard(msg.actor)
                self.freed += 1
            self._finish(msg, start, t.result())
        self._task(coro).add_done_callback(done)

    def _finish(self, msg: Call, start: int, out: Outcome) -> None:
        self.telemetry.ran(msg, start, out.ok)
        if out.value is not None:
            if msg.port is not None:
                self.worker.send_port(PortSend(msg.port if msg.port.rank is not None else
                                               replace(msg.port, rank=self.rank), out.ok, out.value))
            elif msg.want_reply:
                self.worker.post(Reply(msg.call_id, msg.reply_to, self.rank, out.ok, out.value))
        if out.fault:
            self._report(msg.actor, out)

    def _report(self, name: str, outcome: Outcome) -> None:
        """Actor `name` failed and stopped: its owner is told through the controller."""
        print(f"monarch: actor {name!r} on rank {self.rank} {outcome.fault}\n{outcome.detail}", file=sys.stderr)
        self.worker.post(ActorFault(name, outcome.fault, outcome.detail))

    def _supervised(self, msg: Supervise, actor: HostedActor | None, handled: bool) -> None:
        if not handled:
            raised = actor.fault.detail if actor is not None and actor.fault is not None else ""
            self.worker.post(Escalate(msg.failure, msg.actor, raised))
