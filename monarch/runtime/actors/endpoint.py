"""Actors and endpoints: the `Actor` base class, the `@endpoint` decorators and the endpoint table.

An endpoint is a method (sync or `async def`) that other processes may call. Inside the actor an
endpoint is an ordinary method; on a mesh reference it is an `EndpointRef` with the call adverbs.
`@endpoint(explicit_response_port=True)` passes the reply port as the first argument (the body answers
through it, now or later, or not at all); `@concurrent_endpoint` lets later messages run while an
async body awaits. As in Monarch, one actor class has either sync or async endpoints, not both.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, overload

SUPERVISE = "__supervise__"
INITIALIZED, STOP = "__initialized__", "__stop__"  # what ActorMesh.initialized and .stop call


class Actor:
    """Base class of actors. Subclass it, mark methods with `@endpoint`, spawn it on a ProcMesh.

    An actor may define `__supervise__(self, failure)`: it is called with a `MeshFailure` when an actor
    or a process this actor owns (spawned) fails; a truthy return handles it, otherwise it goes on to
    this actor's owner, up to the client's `monarch.actor.unhandled_fault_hook`.
    """


class Endpoint:
    """A method marked callable from other processes."""

    def __init__(self, fn: Callable[..., Any], explicit_response_port: bool = False, concurrent: bool = False) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.explicit_response_port = explicit_response_port
        self.concurrent = concurrent
        self.__doc__ = fn.__doc__
        if concurrent and not self.is_async:
            raise ValueError(f"@concurrent_endpoint {fn.__qualname__} must be an `async def`: only an async body "
                             "can let later messages run while it waits")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)

    def __repr__(self) -> str:
        return f"<endpoint {self.fn.__qualname__}>"


@overload
def endpoint(fn: Callable[..., Any], /) -> Endpoint: ...


@overload
def endpoint(*, explicit_response_port: bool = False, propagate: Any = None) -> Callable[[Callable[..., Any]], Endpoint]:
    ...


def endpoint(fn: Callable[..., Any] | None = None, /, *, explicit_response_port: bool = False,
             propagate: Any = None) -> Any:
    """Mark an actor method as an endpoint: `@endpoint`, or `@endpoint(explicit_response_port=True)`."""
    if fn is None:
        return lambda f: endpoint(f, explicit_response_port=explicit_response_port)
    if not callable(fn):
        raise TypeError(f"@endpoint decorates a method, got {fn!r}")
    return Endpoint(fn, explicit_response_port)


def concurrent_endpoint(fn: Callable[..., Any]) -> Endpoint:
    """An async endpoint whose body runs as a task: the actor takes its next messages while it awaits
    (bodies start in arrival order)."""
    return Endpoint(fn, concurrent=True)


def endpoints_of(cls: type) -> dict[str, Endpoint]:
    """The endpoint table of an actor class, base classes included; mixing sync and async endpoints in
    one class is refused, as Monarch refuses it."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn takes a subclass of monarch.actor.Actor, got {cls!r}")
    table: dict[str, Endpoint] = {}
    for klass in reversed(cls.__mro__):
        table.update({k: v for k, v in vars(klass).items() if isinstance(v, Endpoint)})
    kinds = {ep.is_async for ep in table.values()}
    if len(kinds) > 1:
        sync = sorted(n for n, ep in table.items() if not ep.is_async)
        async_ = sorted(n for n, ep in table.items() if ep.is_async)
        raise ValueError(f"actor class {cls.__qualname__} mixes sync endpoints {sync} and async endpoints {async_}; "
                         "an actor's endpoints are all `def` or all `async def` (make them one kind, or split the "
                         "class into two actors)")
    return table
