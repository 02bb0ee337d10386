"""Actor mesh references and the call adverbs (call, call_one, choose, broadcast, stream).

An `ActorMesh` names actors on a view of a proc mesh; it is picklable, so an actor can receive one
and call it (the worker then forwards through the controller). Sending goes through the process's
client (`context.client()`), which is how the same reference works on the controller and on workers.
"""
from __future__ import annotations

import random
import weakref
from collections.abc import Iterator
from typing import Any, Generic, ParamSpec, TypeVar

from monarch.errors import MeshError, MonarchError
from monarch.runtime.actors.endpoint import INITIALIZED, STOP
from monarch.runtime.control import codec
from monarch.runtime.control.client import client
from monarch.runtime.control.commands import CONTROLLER, Call, PortRef
from monarch.runtime.control.futures import CallState, Future, ValueMesh, mesh_result, one_result, stream_futures
from monarch.shape import MeshView, Shape

A = TypeVar("A")  # the actor class of an ActorMesh
P = ParamSpec("P")  # an endpoint's parameters
R = TypeVar("R")  # its result
HOLDS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # proc mesh id -> what keeps it
# running while a ProcMesh or ActorMesh of it exists on the client (proc_mesh.Hold)


class ActorMesh(MeshView, Generic[A]):
    """Actors `name` of class `cls_name`, one per point of `shape` (a view of proc mesh `mesh_id`).
    `ActorMesh[Counter]` names the mesh of a class, as in Monarch. An endpoint named like a method of the
    mesh (`stop`, `slice`, ...) is the endpoint, as in Monarch."""

    def __init__(self, mesh_id: int, name: str, cls_name: str, endpoints: frozenset[str], shape: Shape,
                 spawned: Shape | None = None) -> None:
        self._mesh_id = mesh_id
        self._name = name
        self._cls_name = cls_name
        self._spawned = shape if spawned is None else spawned  # the whole actor mesh, of which shape is a view
        self._endpoints = endpoints
        self._shape = shape
        self._hold = HOLDS.get(mesh_id)
        for attr in endpoints & _METHODS:
            setattr(self, attr, EndpointRef(self, attr))

    def _with_shape(self, shape: Shape) -> ActorMesh[A]:
        return ActorMesh(self._mesh_id, self._name, self._cls_name, self._endpoints, shape, self._spawned)

    def __getattr__(self, attr: str) -> EndpointRef[..., Any]:
        if attr.startswith("_") or attr not in self._endpoints:
            raise AttributeError(f"actor class {self._cls_name} has no endpoint {attr!r}; "
                                 f"its endpoints are {sorted(self._endpoints)}")
        return EndpointRef(self, attr)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorMesh, (self._mesh_id, self._name, self._cls_name, self._endpoints, self._shape, self._spawned))

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._cls_name} {self.extent}>"

    @property
    def initialized(self) -> Future[None]:
        """Done (None) once every actor of this view ran its __init__; raises the error of one that failed."""
        return self._lifecycle(INITIALIZED, "initialized")

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop the actors of this view (after the calls they already got); later calls to them raise
        SupervisionError. Idempotent; the Future is done once every actor stopped."""
        return self._lifecycle(STOP, f"stop ({reason})")

    def _lifecycle(self, endpoint: str, what: str) -> Future[None]:
        c = client()
        state = CallState(self._shape, f"{self._name}.{what}", (self._mesh_id, self._name))
        call = Call(c.next_call_id(), CONTROLLER, self._name, endpoint, codec.dumps(((), {})), True)
        try:
            c.send(self._mesh_id, self._shape, call, state)
        except MonarchError as e:  # its proc mesh is gone: so are the actors
            state.fail_missing(e)
            if endpoint == STOP:
                return resolved(None)
        return Future(state, c, _none)


def _none(state: CallState) -> None:
    mesh_result(state)  # raises the error of the lowest failing rank


def resolved(value: R) -> Future[R]:
    """A Future that is done already, holding `value`."""
    state = CallState(_SINGLETON, "a finished operation")
    state.deliver(0, True, value)
    return Future(state, client(), one_result)


_SINGLETON = Shape.row_major((), ())


class EndpointRef(Generic[P, R]):
    """One endpoint of an actor mesh view, with the ways to call it (endpoint.MeshEndpoint): P and R are
    the endpoint method's parameters and result."""

    def __init__(self, mesh: ActorMesh[Any], name: str) -> None:
        self._mesh = mesh
        self._name = name

    def _send(self, shape: Shape, args: tuple, kwargs: dict, want_reply: bool) -> tuple[CallState | None, Any]:
        c = client()
        what = f"{self._mesh._name}.{self._name}"
        state = CallState(shape, what, (self._mesh._mesh_id, self._mesh._name)) if want_reply else None
        call = Call(c.next_call_id(), CONTROLLER, self._mesh._name, self._name, codec.dumps((args, kwargs)), want_reply,
                    view=self._view(shape))
        try:
            c.send(self._mesh._mesh_id, shape, call, state)
        except BaseException as e:
            if state is not None:
                state.fail_missing(e)  # never sent: no actor is busy with it
            raise
        return state, c

    def _view(self, shape: Shape) -> tuple | None:
        """What a call carries for context().message_rank: nothing when it goes to the whole actor mesh, else
        the view's fields (a plain tuple: it pickles in a fraction of a Shape's time)."""
        return None if shape == self._mesh._spawned else (shape.labels, shape.sizes, shape.strides, shape.offset)

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every actor of the view; the Future holds a ValueMesh of their answers."""
        state, c = self._send(self._mesh._shape, args, kwargs, True)
        return Future(state, c, mesh_result)  # type: ignore[arg-type]

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the only actor of a singleton view."""
        shape = self._mesh._shape
        if len(shape) != 1:
            raise MeshError(f"call_one on {self._mesh._name}.{self._name} needs a mesh of one actor, this one has "
                            f"{len(shape)} ({shape.extent}); slice it first, or use call() or choose()")
        state, c = self._send(shape, args, kwargs, True)
        return Future(state, c, one_result)  # type: ignore[arg-type]

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one actor of the view, picked at random."""
        state, c = self._send(_one_of(self._mesh._shape), args, kwargs, True)
        return Future(state, c, one_result)  # type: ignore[arg-type]

    def _send_to(self, args: tuple, kwargs: dict, port: PortRef | None, choose: bool) -> None:
        """Call without waiting; each actor's answer goes to `port` (ports.send)."""
        c = client()
        shape = _one_of(self._mesh._shape) if choose else self._mesh._shape
        call = Call(c.next_call_id(), CONTROLLER, self._mesh._name, self._name, codec.dumps((args, kwargs)), False,
                    view=self._view(shape), port=port)
        c.send(self._mesh._mesh_id, shape, call, None)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every actor of the view without waiting; failures are printed by the failing rank."""
        self._send(self._mesh._shape, args, kwargs, False)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]:
        """Call every actor; yield one Future per actor at once, the n-th holding the n-th answer to arrive
        (`for f in stream(): f.get()`, or `await f` in a coroutine)."""
        state, c = self._send(self._mesh._shape, args, kwargs, True)
        return stream_futures(state, c)  # type: ignore[arg-type]


_METHODS = frozenset(n for n in dir(ActorMesh) if not n.startswith("_") and callable(getattr(ActorMesh, n)))


def _one_of(shape: Shape) -> Shape:
    """A view of one point of `shape`, picked at random."""
    point = shape.point(random.randrange(len(shape)))
    return shape.slice(**dict(zip(shape.labels, point.coords, strict=True)))
