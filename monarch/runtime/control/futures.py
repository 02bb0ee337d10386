"""Results of actor calls: per-call reply collection (`CallState`), `Future` and `ValueMesh`, and what a
channel's receiving end (`Inbox`) offers the client that delivers into it.

A CallState gathers one reply per rank of the called view; the client that sent the call (controller or
worker) knows how to wait for it. Values stay pickled until the caller reads them.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from monarch.errors import MeshError
from monarch.runtime.control import codec
from monarch.runtime.control.handlers.breakpoints import BREAKPOINTS
from monarch.shape import MeshView, Point, Shape

R = TypeVar("R")
NOTICE_AFTER_S = 2.0  # the first wait of the client that lasts this long says what it waits for (once)


class Waiter(Protocol):
    """The side that sent a call: it can block until the call's state changes."""
    threaded: bool

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None: ...


class Inbox(Protocol):
    """A channel's receiving end (monarch.runtime.actors.ports.Inbox), where a port's messages are put."""

    def put(self, ok: bool, value: bytes, rank: int | None) -> None: ...


class CallState:
    """Replies of one call, indexed by position in the called view (row-major). `actor` is (proc mesh id,
    actor name) for an actor call: until it is answered, a later call to that actor that times out names it."""

    def __init__(self, shape: Shape, what: str, actor: tuple[int, str] | None = None) -> None:
        self.shape = shape
        self.what = what
        self.actor = actor
        self.sent = time.monotonic()
        ranks = shape.ranks()
        self.index = {r: i for i, r in enumerate(ranks)}
        self.raw: list[tuple[bool, Any] | None] = [None] * len(ranks)
        self.arrived: list[int] = []
        self._lock = threading.Lock()
        self._callbacks: list[tuple[int, Callable[[], None]]] = []  # (replies it waits for, callback)
        if actor is not None:
            _unanswered[id(self)] = self

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
            n = len(self.arrived)
            ready = [cb for need, cb in self._callbacks if need <= n] if self._callbacks else []
            if ready:
                self._callbacks = [(need, cb) for need, cb in self._callbacks if need > n]
        if n == len(self.raw):
            _unanswered.pop(id(self), None)
        for cb in ready:
            cb()

    def fail_missing(self, exc: BaseException) -> None:
        for r, i in self.index.items():
            if self.raw[i] is None:
                self.deliver(r, False, exc)

    def missing(self) -> set[int]:
        """Ranks that have not answered yet."""
        return {r for r, i in self.index.items() if self.raw[i] is None}

    def on_arrived(self, n: int, cb: Callable[[], None]) -> None:
        """Call `cb` once `n` replies came (now, if they did)."""
        with self._lock:
            if len(self.arrived) < n:
                self._callbacks.append((n, cb))
                return
        cb()

    def on_done(self, cb: Callable[[], None]) -> None:
        self.on_arrived(len(self.raw), cb)

    def wait(self, n: int, timeout: float | None) -> None:
        """Block this thread until `n` replies came or `timeout` passed (another thread delivers them)."""
        came = threading.Event()
        self.on_arrived(n, came.set)
        came.wait(None if timeout is None else max(timeout, 0.0))

    def value(self, i: int) -> Any:
        ok, payload = self.raw[i]  # type: ignore[misc]
        obj = codec.loads(payload) if isinstance(payload, bytes) else payload
        if not ok:
            raise obj
        return obj


_unanswered: dict[int, CallState] = {}  # id -> actor calls of this process that some rank has not answered


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def timed_out(state: CallState, timeout: float | None) -> TimeoutError:
    """The error of a wait that ran out, naming the earlier call the actor is still busy with, if any (such
    as one whose `get()` was interrupted with Ctrl-C: the remote call runs on)."""
    ranks = state.missing()
    paused = BREAKPOINTS.waiting_note(state.actor[0], ranks) if state.actor is not None else ""
    text = f"{state.what} did not answer within {timeout} s{paused}"
    ahead = [o for o in list(_unanswered.values()) if o is not state and o.actor == state.actor
             and o.sent <= state.sent and o.missing() & ranks] if state.actor is not None else []
    if not ahead:
        return TimeoutError(text)
    busy = min(ahead, key=lambda o: o.sent)
    return TimeoutError(f"{text}: the actor is still busy with {busy.what}, called {time.monotonic() - busy.sent:.1f} "
                        f"s ago and not answered yet on rank(s) {sorted(busy.missing() & ranks)}. An actor runs one "
                        "call at a time, so this one waits behind it; a call keeps running when its get() is given up "
                        "or interrupted (Ctrl-C). Wait for that call's future, or give get() a longer timeout")


class Future(Generic[R]):
    """The eventual result of a call: `get(timeout)` blocks, `await` suspends. It is done once `arrived`
    replies came (default: all of them)."""

    def __init__(self, state: CallState, waiter: Waiter, result: Callable[[CallState], R],
                 arrived: int | None = None) -> None:
        self._state, self._waiter, self._result = state, waiter, result
        self._need = len(state.raw) if arrived is None else arrived

    def done(self) -> bool:
        return len(self._state.arrived) >= self._need

    def get(self, timeout: float | None = None) -> R:
        if not self.done():
            _wait(self._waiter, self._state, deadline_of(timeout), self._need)
            if not self.done():
                raise timed_out(self._state, timeout)
        return self._result(self._state)

    result = get

    def __await__(self) -> Generator[Any, None, R]:
        """Suspend until done: on the controller (a reader thread delivers) and in an async endpoint on a
        worker (whose loop goes on serving messages meanwhile); other loops block in get()."""
        if not self.done():
            loop = asyncio.get_running_loop()
            if self._waiter.threaded or getattr(self._waiter, "loop", None) is loop:
                fut = loop.create_future()
                self._state.on_arrived(self._need, lambda: _settle_soon(loop, fut))
                yield from fut.__await__()
        return self.get()

    def __repr__(self) -> str:
        return f"<Future {self._state.what} {'done' if self.done() else 'pending'}>"


_noticed: list[bool] = []


def _wait(waiter: Waiter, state: CallState, deadline: float | None, n: int) -> None:
    """Wait for `n` replies of `state` until `deadline`. On the client, the first wait that lasts over
    NOTICE_AFTER_S writes one line on stderr first (a mesh's first tensor op waits for its workers to
    import torch, which can take 10-20 s with nothing else to show)."""
    if not _noticed and waiter.threaded:
        soon = time.monotonic() + NOTICE_AFTER_S
        waiter.wait(state, soon if deadline is None else min(soon, deadline), n)
        if len(state.arrived) >= n or (deadline is not None and time.monotonic() >= deadline):
            return
        _noticed.append(True)
        sys.stderr.write(f"monarch: still waiting for {state.what} after {NOTICE_AFTER_S:g} s (workers load torch "
                         "on their first tensor operation, which can take 10-20 s) ...\n")
        sys.stderr.flush()
    waiter.wait(state, deadline, n)


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
    """Yield one Future per rank at once (never blocking, so that a coroutine can await each in turn): the
    n-th holds the n-th reply to arrive (a dead rank fails its own)."""
    for n in range(len(state.raw)):
        yield Future(state, waiter, partial(_nth_value, n), n + 1)


def _nth_value(n: int, state: CallState) -> Any:
    return state.value(state.arrived[n])
