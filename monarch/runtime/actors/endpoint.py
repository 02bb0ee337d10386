"""Actors and endpoints: the `Actor` base class, the `@endpoint` decorators and the endpoint table.

An endpoint is a method (sync or `async def`) that other processes may call. Inside the actor an
endpoint is an ordinary method; on a mesh reference it is an `EndpointRef` with the call adverbs.
`@endpoint(explicit_response_port=True)` passes the reply port as the first argument (the body answers
through it, now or later, or not at all); `@concurrent_endpoint` lets later messages run while an
async body awaits. As in Monarch, one actor class has either sync or async endpoints, not both.
`Endpoint[P, R]` carries the method's parameters and result type (of an `async def`, what it returns)
to a type checker, which sees `spawn`'s result as the actor class, as Monarch's types have it.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from monarch.runtime.control.futures import Future, ValueMesh
from monarch.shape import MeshView

SUPERVISE = "__supervise__"
INITIALIZED, STOP = "__initialized__", "__stop__"  # what ActorMesh.initialized and .stop call
P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[Any, P], Awaitable[R]] | Callable[Concatenate[Any, P], R]

if TYPE_CHECKING:
    _Seen = MeshView  # a type checker sees an actor class as its mesh, spawn's result (as in Monarch)
else:
    _Seen = object


class Actor(_Seen):
    """Base class of actors. Subclass it, mark methods with `@endpoint`, spawn it on a ProcMesh.

    An actor may define `__supervise__(self, failure)`: it is called with a `MeshFailure` when an actor
    or a process this actor owns (spawned) fails; a truthy return handles it, otherwise it goes on to
    this actor's owner, up to the client's `monarch.actor.unhandled_fault_hook`.
    """
    if TYPE_CHECKING:
        @property
        def initialized(self) -> Future[None]: ...

        def stop(self, reason: str = "stopped by client") -> Future[None]: ...


class MeshEndpoint(Protocol[P, R]):
    """An endpoint on an actor mesh (actor_mesh.EndpointRef): the ways to call it, typed by the method."""

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]: ...

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]: ...

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]: ...

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]: ...


class Endpoint(Generic[P, R]):
    """A method marked callable from other processes; P and R are its parameters and result."""

    def __init__(self, fn: Method[P, R], explicit_response_port: bool = False, concurrent: bool = False) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.explicit_response_port = explicit_response_port
        self.concurrent = concurrent
        self.__doc__ = fn.__doc__
        if concurrent and not self.is_async:
            raise ValueError(f"@concurrent_endpoint {fn.__qualname__} must be an `async def`: only an async body "
                             "can let later messages run while it waits")

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Endpoint[P, R]: ...

    @overload
    def __get__(self, obj: Actor, owner: type | None = None) -> MeshEndpoint[P, R]: ...

    def __get__(self, obj: Actor | None, owner: type | None = None) -> Any:
        """The endpoint on the class; the method itself on an actor (to a type checker, which sees a
        spawned mesh as its actor class, the endpoint of that mesh)."""
        return self if obj is None else types.MethodType(self.fn, obj)

    def __repr__(self) -> str:
        return f"<endpoint {self.fn.__qualname__}>"


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]], /) -> Endpoint[P, R]: ...


@overload
def endpoint(fn: Callable[Concatenate[Any, P], R], /) -> Endpoint[P, R]: ...


@overload
def endpoint(*, explicit_response_port: bool = False,
             propagate: Any = None) -> Callable[[Callable[..., Any]], Endpoint[..., Any]]: ...


def endpoint(fn: Callable[..., Any] | None = None, /, *, explicit_response_port: bool = False,
             propagate: Any = None) -> Any:
    """Mark an actor method as an endpoint: `@endpoint`, or `@endpoint(explicit_response_port=True)`."""
    if fn is None:
        return lambda f: _marked(f, explicit_response_port)
    return _marked(fn, explicit_response_port)


def _marked(fn: Callable[..., Any], explicit_response_port: bool) -> Endpoint[..., Any]:
    if not callable(fn):
        raise TypeError(f"@endpoint decorates a method, got {fn!r}")
    return Endpoint(fn, explicit_response_port)


def concurrent_endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> Endpoint[P, R]:
    """An async endpoint whose body runs as a task: the actor takes its next messages while it awaits
    (bodies start in arrival order)."""
    return Endpoint(fn, concurrent=True)


def endpoints_of(cls: type) -> dict[str, Endpoint[..., Any]]:
    """The endpoint table of an actor class, base classes included; mixing sync and async endpoints in
    one class is refused, as Monarch refuses it."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn takes a subclass of monarch.actor.Actor, got {cls!r}")
    table: dict[str, Endpoint[..., Any]] = {}
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
