"""Actors and endpoints: the `Actor` base class, the `@endpoint` decorator and the endpoint table.

An endpoint is a method (sync or `async def`) that other processes may call. Inside the actor an
endpoint is an ordinary method; on a mesh reference it is an `EndpointRef` with the call adverbs.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any


class Actor:
    """Base class of actors. Subclass it, mark methods with `@endpoint`, spawn it on a ProcMesh.

    An actor may define `__supervise__(self, failure)`: it is called with a `MeshFailure` when a worker
    of another mesh dies while this actor is alive.
    """


class Endpoint:
    """A method marked callable from other processes."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)

    def __repr__(self) -> str:
        return f"<endpoint {self.fn.__qualname__}>"


def endpoint(fn: Callable[..., Any]) -> Endpoint:
    """Mark an actor method as an endpoint."""
    if not callable(fn):
        raise TypeError(f"@endpoint decorates a method, got {fn!r}")
    return Endpoint(fn)


def endpoints_of(cls: type) -> dict[str, Endpoint]:
    """The endpoint table of an actor class, base classes included."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn takes a subclass of monarch.actor.Actor, got {cls!r}")
    table: dict[str, Endpoint] = {}
    for klass in reversed(cls.__mro__):
        table.update({k: v for k, v in vars(klass).items() if isinstance(v, Endpoint)})
    return table
