"""The actor host in one process: an async endpoint's task is stepped a bounded number of rounds at a time,
and the host says when its event loop has work next (now, at a timer, or never) without looking inside asyncio."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch.actor import Actor, endpoint
from monarch.runtime.actors.host import STEPS, ActorHost
from monarch.runtime.control import codec
from monarch.runtime.control.commands import Call, Reply, SpawnActor
from monarch.runtime.telemetry.events import Collector
from monarch.shape import Shape

T = 10.0  # seconds: generous bound for every wait


class Sleeper(Actor):
    @endpoint
    async def nap(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"

    @endpoint
    async def spin(self, rounds: int) -> int:
        for _ in range(rounds):
            await asyncio.sleep(0)
        return rounds


class FakeWorker:
    """What the host uses of control.worker.Worker: its rank and where its messages go."""
    rank, mesh_id = 0, 0

    def __init__(self) -> None:
        self.posted: list[Any] = []

    def post(self, msg: Any) -> None:
        self.posted.append(msg)


def _host() -> tuple[ActorHost, FakeWorker]:
    worker = FakeWorker()
    host = ActorHost(worker, Collector(0, lambda: ()))  # type: ignore[arg-type]
    host.spawn(SpawnActor("sleeper", codec.dumps(Sleeper), codec.dumps(((), {})), Shape.row_major(("dp",), (1,))))
    return host, worker


def _call(host: ActorHost, endpoint_name: str, arg: Any, call_id: int = 1) -> Call:
    msg = Call(call_id, 0, "sleeper", endpoint_name, codec.dumps(((arg,), {})))
    host.call(msg)
    return msg


def test_a_sleeping_endpoint_is_due_at_its_timer_and_its_actor_waits_meanwhile() -> None:
    host, worker = _host()
    msg = _call(host, "nap", 0.2)
    host.step()
    due = host.due()
    assert due is not None and 0.0 < due <= 0.2, due
    assert host.waits(msg) and not worker.posted
    deadline = time.monotonic() + T
    while not worker.posted and time.monotonic() < deadline:
        time.sleep(host.due() or 0.0)
        host.step()
    (reply,) = worker.posted
    assert isinstance(reply, Reply) and codec.loads(reply.value) == "rested"
    assert host.freed == 1 and not host.waits(msg) and host.due() is None


def test_a_step_runs_a_bounded_number_of_rounds_and_says_there_is_more() -> None:
    host, worker = _host()
    _call(host, "spin", 3 * STEPS)
    host.step()
    assert not worker.posted and host.due() == 0.0
    for _ in range(10):
        host.step()
    (reply,) = worker.posted
    assert codec.loads(reply.value) == 3 * STEPS and host.due() is None
