"""Actor hosting on a worker: construct actors, run their endpoints, turn outcomes into replies and faults.

`HostedActor.call` runs a sync endpoint at once and returns its `Outcome`; for an async endpoint it
returns a coroutine that the actor host (host.py) runs as a task on its event loop (the actor takes no other message
meanwhile unless the endpoint is a `@concurrent_endpoint`). Supervision follows Monarch: an exception
with a caller waiting goes to the caller as `ActorError` and the actor lives; an `__init__` that raises,
an exception in a broadcast (nobody to tell), one escaping an explicit-response-port endpoint, and any
BaseException stop the actor and make a fault (a supervision event for its owner).
"""
from __future__ import annotations

import asyncio
import traceback
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from monarch.errors import ActorError, MonarchError, SupervisionError
from monarch.runtime.actors.context import CURRENT, Context, CreatorInstance, Instance
from monarch.runtime.actors.endpoint import INITIALIZED, STOP, SUPERVISE, Endpoint, endpoints_of
from monarch.runtime.actors.ports import DROP, Port, reply_port
from monarch.runtime.control import codec
from monarch.runtime.control.client import POINT, current_rank
from monarch.runtime.control.commands import Call, MeshFailure, SpawnActor
from monarch.shape import Extent, Point, Shape


@dataclass(frozen=True)
class Outcome:
    """What one call came to: the pickled answer (None: the endpoint answers through its port), and
    `fault` (a status) when the actor failed and stopped."""
    ok: bool
    value: bytes | None
    fault: str = ""
    detail: str = ""


class HostedActor:
    """One actor instance on this worker, or the error its construction raised (then it is stopped)."""

    def __init__(self, msg: SpawnActor, rank: int, mesh_id: int) -> None:
        self.name = msg.name
        self.rank = rank
        self.mesh_id = mesh_id
        self.point = msg.shape.point(msg.shape.ranks().index(rank))
        self.instance: Any = None
        self.endpoints: dict[str, Endpoint] = {}
        self.stopped: MonarchError | None = None
        self.fault: Outcome | None = None  # the failure of __init__, reported once spawned
        self.info = Instance(self.point, msg.name, None, f"{msg.name}[{rank}]")
        self._ctx = Context(self.info, self.point)  # a call of the whole actor mesh
        try:
            cls = codec.loads(msg.cls)
            self.info.class_name = f"{cls.__module__}.{cls.__qualname__}"
            extra = codec.loads(msg.context) if msg.context else {}
            self.info.creator = extra.get("creator")
            self.info.proc_mesh = extra.get("proc_mesh")
            args, kwargs = codec.loads(msg.args)
            self.endpoints = endpoints_of(cls)
            with self._running(self.point):
                self.instance = cls(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the actor stops; its owner is told
            self.fault = self._fail(e, "__init__", True)

    def _running(self, message_rank: Any) -> _Running:
        ctx = self._ctx if message_rank is self.point else Context(self.info, message_rank)
        return _Running(ctx, self.point)

    def _error(self, e: BaseException, what: str) -> ActorError:
        tb = "".join(traceback.format_exception(e))
        where = self.point.label() or "singleton"
        return ActorError(f"{type(e).__name__}: {e}\n  raised by {self.name}.{what} on rank {self.rank} ({where}); "
                          f"the failures table and monarch.debug() show it in context\n\nRemote traceback:\n{tb}",
                          rank=self.rank, coords=where, what=f"{self.name}.{what}", remote_traceback=tb,
                          exc_type=type(e).__name__)

    def _fail(self, e: BaseException, what: str, fatal: bool) -> Outcome:
        err = self._error(e, what)
        if not fatal:
            return Outcome(False, codec.dumps(err))
        self.stopped = ActorError(f"actor {self.name!r} on rank {self.rank} is stopped: it failed in {what}: "
                                  f"{type(e).__name__}: {e}; spawn it again", rank=self.rank, coords=err.coords,
                                  what=err.what, remote_traceback=err.remote_traceback, exc_type=err.exc_type)
        return Outcome(False, codec.dumps(err), f"failed in {what}: {type(e).__name__}: {e}", str(err))

    def as_creator(self) -> CreatorInstance:
        return self.info.as_creator()

    # -- calls -----------------------------------------------------------------------------------
    def call(self, msg: Call) -> Outcome | Coroutine[Any, Any, Outcome]:
        """Run one call: a sync endpoint now, an async one as the returned coroutine."""
        if msg.endpoint in (INITIALIZED, STOP):
            return self._lifecycle(msg.endpoint)
        if self.stopped is not None:
            return Outcome(False, codec.dumps(self.stopped))
        ep = self.endpoints.get(msg.endpoint)
        try:
            if ep is None:
                raise AttributeError(f"{type(self.instance).__name__} has no endpoint {msg.endpoint!r}")
            a, kw = codec.loads(msg.args)
        except Exception as e:  # noqa: BLE001 - the caller gets it
            return Outcome(False, codec.dumps(self._error(e, msg.endpoint)))
        if ep.explicit_response_port:
            a = (self._port(msg), *a)
        rank = self._message_rank(msg)
        if ep.is_async:
            return self._run_async(ep, msg, a, kw, rank)
        try:
            with self._running(rank):
                out = ep.fn(self.instance, *a, **kw)
        except BaseException as e:  # noqa: BLE001 - the caller or the owner gets it
            return self._failed(e, ep, msg)
        return self._answer(ep, out, msg)

    def _lifecycle(self, endpoint: str) -> Outcome:
        """ActorMesh.initialized (None once __init__ ran; why it failed) and ActorMesh.stop (later calls fail)."""
        if endpoint == STOP and self.stopped is None:
            self.stopped = SupervisionError(f"actor {self.name!r} on rank {self.rank} was stopped (ActorMesh.stop()); "
                                            "spawn a new actor mesh to call it again", rank=self.rank)
            self.instance = None
        if endpoint == INITIALIZED and self.stopped is not None:
            return Outcome(False, codec.dumps(self.stopped))
        return Outcome(True, codec.dumps(None))

    async def _run_async(self, ep: Endpoint, msg: Call, a: tuple, kw: dict, rank: Any) -> Outcome:
        try:
            with self._running(rank):
                out = await ep.fn(self.instance, *a, **kw)
        except BaseException as e:  # noqa: BLE001 - the caller or the owner gets it
            return self._failed(e, ep, msg)
        return self._answer(ep, out, msg)

    def _failed(self, e: BaseException, ep: Endpoint, msg: Call) -> Outcome:
        nobody = not msg.want_reply and msg.port is None
        return self._fail(e, ep.name, not isinstance(e, Exception) or nobody or ep.explicit_response_port)

    def _answer(self, ep: Endpoint, out: Any, msg: Call) -> Outcome:
        if ep.explicit_response_port or not msg.want_reply and msg.port is None:
            return _NOTHING
        try:
            return Outcome(True, codec.dumps(out))
        except Exception as e:  # noqa: BLE001 - an unpicklable result fails this call only
            return Outcome(False, codec.dumps(self._error(e, f"{ep.name} (pickling its result)")))

    def _port(self, msg: Call) -> Port[Any]:
        if msg.port is not None:
            return Port(msg.port if msg.port.rank is not None else replace(msg.port, rank=self.rank))
        if msg.want_reply:
            return reply_port(self.mesh_id, msg.reply_to, msg.call_id, self.rank)
        return Port(DROP)

    def _message_rank(self, msg: Call) -> Any:
        if msg.view is None:
            return self.point
        if not msg.view[0]:
            return _SINGLE_POINT  # a call of one actor
        view = Shape(*msg.view)
        ranks = view.ranks()
        return view.point(ranks.index(self.rank)) if self.rank in ranks else self.point

    # -- supervision -----------------------------------------------------------------------------
    def supervise(self, failure: MeshFailure) -> bool | Coroutine[Any, Any, bool]:
        """Give `failure` to this actor's __supervise__: whether it handled it (a truthy result), or a
        coroutine saying so for an async hook. A hook that raises fails this actor too (returns False)."""
        hook = getattr(self.instance, SUPERVISE, None) if self.stopped is None else None
        if hook is None:
            return False
        try:
            with self._running(self.point):
                out = hook(failure)
        except BaseException as e:  # noqa: BLE001 - this actor fails as well
            self.fault = self._fail(e, SUPERVISE, True)
            return False
        if asyncio.iscoroutine(out):
            return self._await_hook(out)
        return bool(out)

    async def _await_hook(self, out: Any) -> bool:
        try:
            with self._running(self.point):
                return bool(await out)
        except BaseException as e:  # noqa: BLE001
            self.fault = self._fail(e, SUPERVISE, True)
            return False


def calling_actor(frame: FrameType | None) -> tuple[str, str, str, FrameType | None]:
    """(actor, endpoint, coords, endpoint frame) of the hosted actor whose call runs `frame`: found up the
    stack, where the worker runs the endpoint (or constructs the actor: "__init__"). What the relayed pdb
    (debug/relay.py) shows of a paused rank."""
    below = None
    while frame is not None:
        hosted = frame.f_locals.get("self")
        if isinstance(hosted, HostedActor):
            return hosted.name, _endpoint_of(frame), hosted.point.label(), below
        below, frame = frame, frame.f_back
    return "", "", current_rank().label(), None


def _endpoint_of(frame: FrameType) -> str:
    """The endpoint a HostedActor frame runs: its `endpoint` or its call message's, else by the method."""
    named, called = frame.f_locals.get("endpoint"), getattr(frame.f_locals.get("msg"), "endpoint", None)
    if isinstance(named, str):
        return named
    if isinstance(called, str):
        return called
    return {"__init__": "__init__", "supervise": "__supervise__"}.get(frame.f_code.co_name, frame.f_code.co_name)


_NOTHING = Outcome(True, None)
_SINGLE_POINT = Point((), Extent((), ()))  # a call answered through its port, or that nobody waits for


class _Running:
    """context() and current_rank() of a running endpoint, set and reset (a class: the call path is hot)."""
    __slots__ = ("ctx", "point", "tokens")

    def __init__(self, ctx: Context, point: Any) -> None:
        self.ctx, self.point = ctx, point

    def __enter__(self) -> None:
        self.tokens = (CURRENT.set(self.ctx), POINT.set(self.point))

    def __exit__(self, *exc: Any) -> None:
        POINT.reset(self.tokens[1])
        CURRENT.reset(self.tokens[0])
