"""What a type checker sees of endpoint calls (checked by mypy in test_endpoint_types.py; never run)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import assert_type

from monarch.actor import Actor, Future, ProcMesh, ValueMesh, endpoint


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n


class Greeter(Actor):
    @endpoint
    async def greet(self, name: str) -> str:
        return f"hello {name}"


def calls(procs: ProcMesh) -> None:
    counters = procs.spawn("counters", Counter, 0)
    assert_type(counters.incr.call(2), Future[ValueMesh[int]])
    assert_type(counters.incr.call_one(), Future[int])
    assert_type(counters.slice(dp=0).incr.call_one(by=3), Future[int])
    assert_type(counters.incr.choose(1), Future[int])
    assert_type(counters.incr.broadcast(5), None)
    assert_type(counters.incr.stream(), Iterator[Future[int]])
    assert_type(counters.initialized, Future[None])
    greeters = procs.spawn("greeters", Greeter)
    assert_type(greeters.greet.call("a"), Future[ValueMesh[str]])
    assert_type(greeters.greet.call_one("a").get(), str)


def refused(procs: ProcMesh) -> None:
    counters = procs.spawn("counters", Counter, 0)
    counters.incr.call("two")  # E: the argument's type
    counters.incr.call(1, 2)  # E: too many arguments
