"""`ProcMesh.logging_option`: where a mesh's worker output goes and which logging records its ranks emit.

The console side (streamed, folded over ranks in windows, or kept off it) is the controller's
(telemetry/logs.py); the level is each rank's: a built-in actor, spawned on the mesh at the first call, sets
its root logger's level, as Monarch's logger actors do. Records at or above it reach the rank's handlers,
or, where the rank configured none, logging's last resort handler (stderr).
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Generator
from typing import Any

from monarch.errors import MeshError
from monarch.runtime.actors.actor_mesh import ActorMesh
from monarch.runtime.actors.endpoint import Actor, endpoint
from monarch.runtime.control.futures import Future
from monarch.runtime.telemetry.logs import OUTPUT, LogMode

AGENT_NAME = "_monarch_logging"  # the level actor's name on every mesh that set an option

_AGENTS: weakref.WeakKeyDictionary[Any, ActorMesh] = weakref.WeakKeyDictionary()  # controller Mesh -> agents


class LogLevel(Actor):
    """One per rank: applies the mesh's logging level to this process."""

    @endpoint
    def set_level(self, level: int) -> int:
        """Set the root logger's level (and the last resort handler's, for ranks without handlers); returns
        the level the root logger had."""
        root = logging.getLogger()
        before = root.level
        root.setLevel(level)
        if logging.lastResort is not None:
            logging.lastResort.setLevel(level)
        return before


class Applied:
    """What `logging_option` returns: `get(timeout)` or `await` returns None once every rank set the level
    (the console side applies at once)."""

    def __init__(self, levels: Future[Any]) -> None:
        self._levels = levels

    def done(self) -> bool:
        return self._levels.done()

    def get(self, timeout: float | None = None) -> None:
        self._levels.get(timeout)

    result = get

    def __await__(self) -> Generator[Any, None, None]:
        yield from self._levels.__await__()

    def __repr__(self) -> str:
        return f"<Future logging_option {'done' if self.done() else 'pending'}>"


def logging_option(procs: Any, stream_to_client: bool = True, aggregate_window_sec: float | None = 3,
                   level: int = logging.INFO) -> Applied:
    """Set how the worker output of `procs`'s whole job reaches this console and the logging level of its
    ranks (see ProcMesh.logging_option)."""
    check(stream_to_client, aggregate_window_sec, level)
    mesh = procs._mesh
    if mesh is None:
        raise MeshError(f"logging_option on proc mesh {procs.name!r} inside an actor: the client's console is "
                        "the controller's; set it where the mesh was spawned")
    OUTPUT.set_mode(mesh.id, LogMode(stream_to_client, aggregate_window_sec))
    if mesh not in _AGENTS:
        _AGENTS[mesh] = procs._with_shape(mesh.shape).spawn(AGENT_NAME, LogLevel)
    return Applied(_AGENTS[mesh].set_level.call(level))


def check(stream_to_client: bool, aggregate_window_sec: float | None, level: int) -> None:
    """Refuse options Monarch refuses (a window without streaming, a level outside 0..255) and windows
    that are not a positive number of seconds."""
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 255:
        raise MeshError(f"logging_option: invalid logging level {level!r}; pass a logging level such as "
                        "logging.INFO (an int in 0..255)")
    if aggregate_window_sec is None:
        return
    if not stream_to_client:
        raise MeshError(f"logging_option: cannot set aggregate_window_sec={aggregate_window_sec!r} without "
                        "streaming to the client; pass aggregate_window_sec=None with stream_to_client=False")
    if isinstance(aggregate_window_sec, bool) or not isinstance(aggregate_window_sec, (int, float)) \
            or not aggregate_window_sec > 0:
        raise MeshError(f"logging_option: aggregate_window_sec must be a positive number of seconds or None "
                        f"(each line at once), not {aggregate_window_sec!r}")
