"""Actor hosting on a worker: construct actors, run their endpoints, turn outcomes into replies.

Each hosted actor runs one message at a time, in arrival order; `async def` endpoints run to
completion on the worker's event loop before the next message. Exceptions become `ActorError`s that
carry the rank, the endpoint and the traceback; the actor keeps serving.
"""
from __future__ import annotations

import asyncio
import sys
import traceback
from typing import Any

from monarch.errors import ActorError
from monarch.runtime.actors.endpoint import Endpoint, endpoints_of
from monarch.runtime.control import codec
from monarch.runtime.control.client import running_as
from monarch.runtime.control.commands import MeshFailure, SpawnActor

_loop: asyncio.AbstractEventLoop | None = None


def _run_coroutine(coro: Any) -> Any:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(coro)


class HostedActor:
    """One actor instance on this worker, or the error its construction raised."""

    def __init__(self, msg: SpawnActor, rank: int) -> None:
        self.name = msg.name
        self.rank = rank
        self.point = msg.shape.point(msg.shape.ranks().index(rank))
        self.instance: Any = None
        self.endpoints: dict[str, Endpoint] = {}
        self.init_error: ActorError | None = None
        try:
            cls = codec.loads(msg.cls)
            args, kwargs = codec.loads(msg.args)
            self.endpoints = endpoints_of(cls)
            with running_as(self.point):
                self.instance = cls(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported on the first call
            self.init_error = self._error(e, "__init__")

    def _error(self, e: BaseException, what: str) -> ActorError:
        tb = "".join(traceback.format_exception(e))
        where = self.point.label() or "singleton"
        return ActorError(f"{type(e).__name__}: {e}\n  raised by {self.name}.{what} on rank {self.rank} ({where}); "
                          f"the failures table and monarch.debug() show it in context\n\nRemote traceback:\n{tb}",
                          rank=self.rank, coords=where, what=f"{self.name}.{what}", remote_traceback=tb,
                          exc_type=type(e).__name__)

    def run(self, endpoint: str, args: bytes) -> tuple[bool, bytes]:
        """Run one endpoint call; the pickled result or pickled ActorError."""
        if self.init_error is not None:
            return False, codec.dumps(self.init_error)
        try:
            ep = self.endpoints.get(endpoint)
            if ep is None:
                raise AttributeError(f"{type(self.instance).__name__} has no endpoint {endpoint!r}")
            a, kw = codec.loads(args)
            with running_as(self.point):
                out = ep.fn(self.instance, *a, **kw)
                if ep.is_async:
                    out = _run_coroutine(out)
            return True, codec.dumps(out)
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            return False, codec.dumps(self._error(e, endpoint))

    def supervise(self, failure: MeshFailure) -> None:
        hook = getattr(self.instance, "__supervise__", None)
        if hook is None:
            return
        try:
            with running_as(self.point):
                out = hook(failure)
                if asyncio.iscoroutine(out):
                    _run_coroutine(out)
        except BaseException as e:  # noqa: BLE001 - a broken hook must not kill the worker
            print(self._error(e, "__supervise__"), file=sys.stderr)
