"""Ports and channels (Monarch's low-level messaging): `Channel.open()` gives a `Port` to send on and a
`PortReceiver` to receive from; `send()` calls an endpoint with its answers going to a port; an
`@endpoint(explicit_response_port=True)` answers through the port it is given; `Accumulator` folds the
answers of a call.

A Port is a picklable reference (commands.PortRef): handed to another actor, it sends from there. Its
messages travel as PortSend through the controller, which delivers them to the receiver's process, or,
for a call's reply port, into the caller's pending call as that rank's answer.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch.errors import MeshError
from monarch.runtime.control import codec
from monarch.runtime.control.client import client
from monarch.runtime.control.commands import PortRef, PortSend
from monarch.runtime.control.futures import CallState, Future, one_result
from monarch.shape import Shape

R = TypeVar("R")
A = TypeVar("A")
DROP = PortRef()  # the port of a call nobody waits for: what is sent there is dropped
_SINGLE = Shape.row_major((), ())
_port_ids = itertools.count(1)


class Port(Generic[R]):
    """Sends values (`send`) or an error (`exception`) to a receiver or to a caller, in order."""

    def __init__(self, ref: PortRef) -> None:
        self._ref = ref

    def send(self, obj: R) -> None:
        self._post(True, codec.dumps(obj))

    def exception(self, obj: BaseException) -> None:
        self._post(False, codec.dumps(obj))

    def _post(self, ok: bool, value: bytes) -> None:
        if self._ref != DROP:
            client().send_port(PortSend(self._ref, ok, value))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Port, (self._ref,))

    def __repr__(self) -> str:
        return f"<Port {self._ref}>"


class Inbox:
    """A receiver's queue in the process that opened the channel: values wait for recv(), or recv()s wait
    for values; a once-port takes one value."""

    def __init__(self, once: bool) -> None:
        self.once = once
        self.values: deque[tuple[bool, bytes, int | None]] = deque()
        self.waiting: deque[CallState] = deque()
        self.closed = False
        self._lock = threading.Lock()  # the controller's reader thread puts, the user's thread takes

    def put(self, ok: bool, value: bytes, rank: int | None) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = self.once
            state = self.waiting.popleft() if self.waiting else None
            if state is None:
                self.values.append((ok, value, rank))
        if state is not None:
            state.deliver(0, ok, value if rank is None else _ranked(ok, value, rank))

    def take(self, state: CallState) -> None:
        with self._lock:
            got = self.values.popleft() if self.values else None
            if got is None:
                self.waiting.append(state)
        if got is not None:
            ok, value, rank = got
            state.deliver(0, ok, value if rank is None else _ranked(ok, value, rank))


def _ranked(ok: bool, value: bytes, rank: int) -> bytes:
    return codec.dumps((rank, codec.loads(value))) if ok else value


class PortReceiver(Generic[R]):
    """Receives what the channel's Port sends: `recv()` is a Future of the next value."""

    def __init__(self, inbox: Inbox, ref: PortRef) -> None:
        self._inbox = inbox
        self._ref = ref

    def recv(self) -> Future[R]:
        state = CallState(_SINGLE, f"recv on port {self._ref.port}")
        self._inbox.take(state)
        return Future(state, client(), one_result)

    def ranked(self) -> RankedPortReceiver[R]:
        return RankedPortReceiver(self._inbox, self._ref)


class RankedPortReceiver(PortReceiver[R]):
    """recv() gives (rank of the sender, value); the sender is an endpoint's call (`send(..., port=)`)."""


class Channel(Generic[R]):
    """Opens port pairs in this process (the controller or an actor's worker)."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        inbox = Inbox(once)
        ref = PortRef(port=next(_port_ids), owner=client().port_owner())
        client().open_port(ref.port, inbox)
        return Port(ref), PortReceiver(inbox, ref)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], RankedPortReceiver[R]]:
        port, receiver = Channel.open(once)
        return port, receiver.ranked()


def reply_port(mesh_id: int, reply_to: int, call_id: int, rank: int) -> Port[Any]:
    """The port of one rank's answer to a call (what an explicit-response-port endpoint is given)."""
    return Port(PortRef(reply=(mesh_id, reply_to, call_id, rank)))


def send(endpoint: Any, args: tuple = (), kwargs: dict[str, Any] | None = None, port: Port[Any] | None = None,
         selection: str = "all") -> None:
    """Call `endpoint` (an actor mesh's endpoint) without waiting; each actor's answer goes to `port` (its
    rank with it: use a ranked receiver), or nowhere. `selection`: "all" actors, or "choose" one."""
    if selection not in ("all", "choose"):
        raise MeshError(f"send(selection={selection!r}): selection is 'all' or 'choose'")
    endpoint._send_to(args, kwargs or {}, None if port is None else port._ref, selection == "choose")


class Accumulator(Generic[R, A]):
    """`Accumulator(mesh.endpoint, identity, combine).accumulate(*args)`: a Future of the answers of every
    actor folded with `combine` into `identity`, in the order they arrive."""

    def __init__(self, endpoint: Any, identity: A, combine: Callable[[A, R], A]) -> None:
        self._endpoint, self._identity, self._combine = endpoint, identity, combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        state, waiter = self._endpoint._send(self._endpoint._mesh._shape, args, kwargs, True)

        def fold(s: CallState) -> A:
            value = self._identity
            for i in list(s.arrived):
                value = self._combine(value, s.value(i))
            return value
        return Future(state, waiter, fold)
