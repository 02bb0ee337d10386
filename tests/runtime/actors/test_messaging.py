"""Messages reach their destination while actors are busy: ports and supervision events while an actor of
the worker is mid-call, sends from threads an actor started, stream() inside an async endpoint, sends made
before an endpoint blocks, and calls that arrive while an actor's constructor waits.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from monarch.actor import Actor, ActorMesh, Channel, MeshFailure, Port, PortReceiver, ProcMesh, endpoint

T = 30.0  # generous bound for every wait that must succeed
PROMPT = 10.0  # a message sent before an endpoint blocks arrives within this while it still blocks


class Looper(Actor):
    """An RL-style loop: a long-running endpoint that awaits what others send to its channel."""

    def __init__(self) -> None:
        self.port, self.recv = Channel.open(once=False)

    @endpoint
    async def get_port(self) -> Port[int]:
        return self.port

    @endpoint
    async def run(self, n: int) -> list[int]:
        return [await self.recv.recv() for _ in range(n)]


class Doomed(Actor):
    @endpoint
    def die(self) -> None:
        raise SystemExit(3)  # a BaseException: stops the actor, a supervision event for its owner


class Owner(Actor):
    def __init__(self) -> None:
        self.seen: list[str] = []

    @endpoint
    async def spawn_and_kill(self, procs: ProcMesh) -> None:
        procs.spawn("doomed", Doomed).die.broadcast()

    @endpoint
    async def seen_failures(self) -> list[str]:
        return self.seen

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.seen.append(failure.actor)
        return True


class Threaded(Actor):
    @endpoint(explicit_response_port=True)
    def ask(self, port: Port[int], v: int) -> None:
        threading.Thread(target=lambda: (time.sleep(0.2), port.send(v * 2))).start()

    @endpoint
    def feed(self, port: Port[str]) -> None:
        threading.Thread(target=lambda: (time.sleep(0.2), port.send("from a thread"))).start()

    @endpoint
    def ask_from_a_thread(self, port: Port[int], other: ActorMesh) -> None:
        threading.Thread(target=lambda: port.send(other.val.call_one().get(timeout=T))).start()


class Five(Actor):
    @endpoint
    async def val(self) -> int:
        return 5


class Streamer(Actor):
    @endpoint
    async def go(self, other: ActorMesh) -> list[int]:
        return [await f for f in other.val.stream()]


class Relay(Actor):
    @endpoint
    def relay(self, port: Port[str], text: str) -> None:
        port.send(text)


class Stuck(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def hold(self, port: Port[str], relay: ActorMesh, release: str) -> str:
        """Send, then block in sync code until the file `release` exists."""
        port.send("before")
        relay.relay.broadcast(port, "relayed")
        deadline = time.monotonic() + 2 * T
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "released"


class Helper(Actor):
    @endpoint
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return 7


class Constructed(Actor):
    """Its constructor waits on a call to another actor; calls that arrive meanwhile wait for it."""

    def __init__(self, helper: ActorMesh) -> None:
        self.n = helper.slow.call_one(1.0).get(timeout=T)

    @endpoint
    def value(self) -> int:
        return self.n


def _recv_all(receiver: PortReceiver[str], n: int, timeout: float) -> list[str]:
    return sorted(receiver.recv().get(timeout=timeout) for _ in range(n))


def test_a_receiver_awaited_in_a_plain_async_endpoint_gets_its_values(procs: ProcMesh) -> None:
    looper = procs.slice(dp=0, tp=0).spawn("looper", Looper)
    port = looper.get_port.call_one().get(timeout=T)
    fut = looper.run.call_one(2)
    time.sleep(0.5)  # run is awaiting its receiver
    port.send(1)
    port.send(2)
    assert fut.get(timeout=T) == [1, 2]


def test_an_owner_is_supervised_while_another_actor_of_its_worker_is_mid_call(procs: ProcMesh, faults: list) -> None:
    one = procs.slice(dp=0, tp=1)
    busy, owner = one.spawn("busy", Looper), one.spawn("owner", Owner)
    port = busy.get_port.call_one().get(timeout=T)
    running = busy.run.call_one(1)
    owner.spawn_and_kill.call_one(procs.slice(dp=1, tp=1)).get(timeout=T)
    deadline = time.monotonic() + T
    while not owner.seen_failures.call_one().get(timeout=T) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.seen_failures.call_one().get(timeout=T) == ["doomed"]
    assert not running.done() and not faults
    port.send(0)
    assert running.get(timeout=T) == [0]


def test_a_port_sends_from_a_thread_the_actor_started(procs: ProcMesh) -> None:
    threaded = procs.slice(dp=1, tp=0).spawn("threaded", Threaded)
    assert threaded.ask.call_one(21).get(timeout=T) == 42
    port, receiver = Channel.open()
    threaded.feed.call_one(port).get(timeout=T)
    assert receiver.recv().get(timeout=T) == "from a thread"
    threaded.ask_from_a_thread.call_one(port, procs.slice(dp=1, tp=0).spawn("five_t", Five)).get(timeout=T)
    assert receiver.recv().get(timeout=T) == 5


def test_stream_inside_an_async_endpoint_aimed_at_its_own_worker(procs: ProcMesh) -> None:
    one = procs.slice(dp=0, tp=0)
    five, streamer = one.spawn("five", Five), one.spawn("streamer", Streamer)
    assert streamer.go.call_one(five).get(timeout=T) == [5]
    assert streamer.go.call_one(procs.spawn("fives", Five)).get(timeout=T) == [5] * 4


def test_what_an_endpoint_sent_arrives_while_it_blocks_in_sync_code(procs: ProcMesh, tmp_path: Path) -> None:
    stuck = procs.slice(dp=1, tp=1).spawn("stuck", Stuck)
    relay = procs.slice(dp=0, tp=0).spawn("relay", Relay)
    port, receiver = Channel.open()
    release = tmp_path / "release"
    pong = stuck.ping.call_one()
    held = stuck.hold.call_one(port, relay, str(release))
    try:
        assert _recv_all(receiver, 2, PROMPT) == ["before", "relayed"]
        assert pong.get(timeout=PROMPT) == "pong"
        assert not held.done()
        assert relay.relay.call_one(port, "the mesh works").get(timeout=T) is None
        assert receiver.recv().get(timeout=T) == "the mesh works"
    finally:
        release.touch()
    assert held.get(timeout=T) == "released"


@pytest.mark.parametrize("where", ["own worker", "other worker"])
def test_calls_wait_for_a_constructor_that_waits(procs: ProcMesh, where: str) -> None:
    helper = procs.slice(dp=1, tp=0).spawn(f"helper_{where[:3]}", Helper)
    home = procs.slice(dp=1, tp=0) if where == "own worker" else procs.slice(dp=0, tp=1)
    constructed = home.spawn(f"constructed_{where[:3]}", Constructed, helper)
    assert constructed.value.call_one().get(timeout=T) == 7
    assert constructed.initialized.get(timeout=T) is None
