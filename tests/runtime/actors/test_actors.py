"""Actors on a real 4-process mesh: adverbs, slicing, ordering, errors, async endpoints, mesh refs."""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from monarch.actor import Actor, ActorError, ActorMesh, ProcMesh, ValueMesh, current_rank, current_size, endpoint
from monarch.errors import MeshError

T = 30  # seconds: generous bound for every wait


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start
        self.log: list[int] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def record(self, i: int) -> None:
        self.log.append(i)

    @endpoint
    def history(self) -> list[int]:
        return self.log

    @endpoint
    def where(self) -> tuple[dict, dict, int]:
        return dict(current_rank()), current_size(), current_rank().rank

    @endpoint
    def mpi(self) -> tuple[int, int]:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

    @endpoint
    def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    def unpicklable(self):
        return lambda: 1 if os.getpid() else 0  # a local lambda over a module: fine for cloudpickle

    @endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)


class Sleepy(Actor):
    """Async endpoints only: an actor's endpoints are all sync or all async (as in Monarch)."""

    def __init__(self, n: int) -> None:
        self.n = n

    @endpoint
    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return self.n


class Broken(Actor):
    def __init__(self) -> None:
        raise RuntimeError("cannot construct")

    @endpoint
    def ping(self) -> int:
        return 1


class Summer(Actor):
    @endpoint
    def total(self, counters: ActorMesh) -> int:
        return sum(counters.value.call().get(timeout=T).values())

    @endpoint
    def total_async(self, counters: ActorMesh) -> int:
        async def go() -> int:
            mesh = await counters.value.call()
            return sum(mesh.values())
        return asyncio.run(go())


@pytest.fixture(scope="module")
def counters(procs: ProcMesh) -> ActorMesh:
    return procs.spawn("counters", Counter, 10)


def test_call_returns_a_value_mesh_with_coordinates(counters: ActorMesh) -> None:
    out = counters.where.call().get(timeout=T)
    assert isinstance(out, ValueMesh) and out.extent == {"dp": 2, "tp": 2}
    for point, (coords, sizes, rank) in out.items():
        assert coords == dict(point) and sizes == {"dp": 2, "tp": 2} and rank == point.rank
    assert out.item(dp=1, tp=0)[0] == {"dp": 1, "tp": 0}
    assert [v[2] for v in out.slice(tp=1).values()] == [1, 3]


def test_workers_know_their_mpi_rank_and_the_controller_never_joins_mpi(counters: ActorMesh) -> None:
    assert counters.mpi.call().get(timeout=T).values() == [(r, 4) for r in range(4)]
    assert "mpi4py.MPI" not in sys.modules


def test_call_one_choose_and_slices(counters: ActorMesh) -> None:
    one = counters.slice(dp=0, tp=1)
    before = one.value.call_one().get(timeout=T)
    assert one.incr.call_one(5).get(timeout=T) == before + 5
    assert isinstance(counters.value.choose().get(timeout=T), int)
    with pytest.raises(MeshError, match="call_one"):
        counters.value.call_one()
    row = counters.slice(dp=1)
    assert row.extent == {"tp": 2} and len(row.value.call().get(timeout=T).values()) == 2
    assert counters.flatten("all").value.call().get(timeout=T).extent == {"all": 4}
    assert counters.rename(dp="data").slice(data=0).extent == {"tp": 2}


def test_broadcast_and_fifo_order(counters: ActorMesh) -> None:
    target = counters.slice(dp=1, tp=1)
    for i in range(200):
        target.record.broadcast(i)
    assert target.history.call_one().get(timeout=T)[-200:] == list(range(200))
    before = counters.value.call().get(timeout=T)
    counters.slice(dp=0).incr.broadcast(3)
    after = counters.value.call().get(timeout=T)
    assert after.slice(dp=0).values() == [v + 3 for v in before.slice(dp=0).values()]
    assert after.slice(dp=1).values() == before.slice(dp=1).values()


def test_stream_yields_one_future_per_actor(counters: ActorMesh) -> None:
    futures = list(counters.value.stream())
    values = [f.get(timeout=T) for f in futures]
    assert len(futures) == 4 and all(f.done() for f in futures)
    assert sorted(values) == sorted(counters.value.call().get(timeout=T).values())


@pytest.fixture(scope="module")
def sleepy(procs: ProcMesh) -> ActorMesh:
    return procs.spawn("sleepy", Sleepy, 10)


def test_async_endpoint_and_await(sleepy: ActorMesh) -> None:
    assert sleepy.slow.call(0.01).get(timeout=T).values() == [10] * 4

    async def main() -> list[int]:
        return (await sleepy.slow.call(0.01)).values()
    assert asyncio.run(main()) == [10] * 4


def test_get_times_out_then_succeeds(sleepy: ActorMesh) -> None:
    fut = sleepy.slice(dp=0, tp=0).slow.call_one(0.5)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    assert isinstance(fut.get(timeout=T), int)


def test_endpoint_error_carries_rank_and_traceback_and_actor_survives(counters: ActorMesh) -> None:
    with pytest.raises(ActorError) as info:
        counters.slice(dp=1, tp=0).boom.call_one("bad input").get(timeout=T)
    e = info.value
    assert e.rank == 2 and e.coords == "dp=1,tp=0" and e.what == "counters.boom" and e.exc_type == "ValueError"
    assert "bad input" in str(e) and "raise ValueError(msg)" in e.remote_traceback
    assert isinstance(counters.slice(dp=1, tp=0).value.call_one().get(timeout=T), int)
    with pytest.raises(ActorError, match="rank 0"):
        counters.boom.call("all fail").get(timeout=T)


def test_init_failure_surfaces_on_first_call(procs: ProcMesh) -> None:
    broken = procs.spawn("broken", Broken)
    with pytest.raises(ActorError, match="cannot construct") as info:
        broken.ping.call().get(timeout=T)
    assert "__init__" in info.value.what and 'raise RuntimeError("cannot construct")' in info.value.remote_traceback


def test_actor_mesh_refs_can_be_passed_and_called(procs: ProcMesh, counters: ActorMesh) -> None:
    summer = procs.slice(dp=0, tp=0).spawn("summer", Summer)
    expected = sum(counters.value.call().get(timeout=T).values())
    assert summer.total.call_one(counters).get(timeout=T) == expected
    assert summer.total_async.call_one(counters).get(timeout=T) == expected
    assert summer.total.call_one(counters.slice(dp=1)).get(timeout=T) == sum(
        counters.slice(dp=1).value.call().get(timeout=T).values())


def test_worker_output_is_prefixed_with_coordinates(counters: ActorMesh, capsys: pytest.CaptureFixture) -> None:
    counters.slice(dp=1, tp=0).say.call_one("hello from a worker").get(timeout=T)
    deadline = time.monotonic() + T
    seen = ""
    while "hello from a worker" not in seen and time.monotonic() < deadline:
        counters.value.call().get(timeout=T)  # polling the control plane also forwards output
        seen += capsys.readouterr().out
    assert "[dp=1,tp=0] hello from a worker" in seen


def test_bad_names_fail_on_the_controller(procs: ProcMesh, counters: ActorMesh) -> None:
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        counters.nope
    with pytest.raises(MeshError, match="already has actors named 'counters'"):
        procs.spawn("counters", Counter, 0)
    with pytest.raises(MeshError, match="no dim 'pp'"):
        counters.slice(pp=0)
    with pytest.raises(TypeError, match="subclass of monarch.actor.Actor"):
        procs.spawn("x", int)


def test_return_values_may_be_closures(counters: ActorMesh) -> None:
    assert counters.slice(dp=0, tp=0).unpicklable.call_one().get(timeout=T)() == 1
