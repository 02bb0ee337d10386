"""Results of actor calls: per-call reply collection (`CallState`), `Future` and `ValueMesh`.

A CallState gathers one reply per rank of the called view; the client that sent the call (controller or
worker) knows how to wait for it. Values stay pickled until the caller reads them.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from monarch.errors import MeshError
from monarch.runtime import codec
from monarch.runtime.shape import MeshView, Point, Shape

R = TypeVar("R")


class Waiter(Protocol):
    """The side that sent a call: it can block until the call's state changes."""
    threaded: bool

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None: ...


class CallState:
    """Replies of one call, indexed by position in the called view (row-major)."""

    def __init__(self, shape: Shape, what: str) -> None:
        self.shape = shape
        self.what = what
        ranks = shape.ranks()
        self.index = {r: i for i, r in enumerate(ranks)}
        self.raw: list[tuple[bool, Any] | None] = [None] * len(ranks)
        self.arrived: list[int] = []
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return len(self.arrived) == len(self.raw)

    def deliver(self, rank: int, ok: bool, payload: Any) -> None:
        """Record rank's outcome: pickled bytes, or an exception object (supervision)."""
        i = self.index[rank]
        with self._lock:
            if self.raw[i] is not None:
                return
            self.raw[i] = (ok, payload)
            self.arrived.append(i)
            callbacks = self._callbacks if self.done else []
        for cb in callbacks:
            cb()

    def fail_missing(self, exc: BaseException) -> None:
        for r, i in self.index.items():
            if self.raw[i] is None:
                self.deliver(r, False, exc)

    def on_done(self, cb: Callable[[], None]) -> None:
        with self._lock:
            if not self.done:
                self._callbacks.append(cb)
                return
        cb()

    def value(self, i: int) -> Any:
        ok, payload = self.raw[i]  # type: ignore[misc]
        obj = codec.loads(payload) if isinstance(payload, bytes) else payload
        if not ok:
            raise obj
        return obj


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class Future(Generic[R]):
    """The eventual result of a call: `get(timeout)` blocks, `await` suspends."""

    def __init__(self, state: CallState, waiter: Waiter, result: Callable[[CallState], R]) -> None:
        self._state, self._waiter, self._result = state, waiter, result

    def done(self) -> bool:
        return self._state.done

    def get(self, timeout: float | None = None) -> R:
        if not self._state.done:
            self._waiter.wait(self._state, deadline_of(timeout), len(self._state.raw))
            if not self._state.done:
                raise TimeoutError(f"{self._state.what} did not answer within {timeout} s")
        return self._result(self._state)

    result = get

    def __await__(self) -> Generator[Any, None, R]:
        if not self._state.done and self._waiter.threaded:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._state.on_done(lambda: _settle_soon(loop, fut))
            yield from fut.__await__()
        return self.get()

    def __repr__(self) -> str:
        return f"<Future {self._state.what} {'done' if self.done() else 'pending'}>"


def _settle_soon(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    loop.call_soon_threadsafe(_settle, fut)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class ValueMesh(MeshView, Generic[R]):
    """One value per point of a mesh view, with the same named-dim methods as every mesh."""

    def __init__(self, shape: Shape, values: list[R]) -> None:
        self._shape = shape
        self._values = values

    def _with_shape(self, shape: Shape) -> ValueMesh[R]:
        return ValueMesh(shape, self._values)

    def items(self) -> Iterator[tuple[Point, R]]:
        for i in range(len(self._shape)):
            p = self._shape.point(i)
            yield p, self._values[self._shape.rank_at(p.coords)]

    def values(self) -> list[R]:
        return [v for _, v in self.items()]

    def item(self, **coords: int) -> R:
        view = self._shape.slice(**coords)
        if view.labels:
            raise MeshError(
                f"item() needs an index for every dim; missing {list(view.labels)} of {self._shape.extent}")
        return self._values[view.offset]

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __repr__(self) -> str:
        return f"ValueMesh({self.extent}, {self.values()!r})"


def mesh_result(state: CallState) -> ValueMesh[Any]:
    """All values of a finished call; raises the error of the lowest failing rank."""
    values = [state.value(i) for i in range(len(state.raw))]
    return ValueMesh(Shape.row_major(state.shape.labels, state.shape.sizes), values)


def one_result(state: CallState) -> Any:
    return state.value(0)


def stream_futures(state: CallState, waiter: Waiter) -> Iterator[Future[Any]]:
    """Yield one finished Future per rank, in the order the replies arrive (a dead rank fails its own)."""
    for n in range(len(state.raw)):
        while len(state.arrived) <= n:
            waiter.wait(state, None, n + 1)
        yield Future(state, waiter, partial(_value_at, state.arrived[n]))


def _value_at(i: int, state: CallState) -> Any:
    return state.value(i)
