"""The exception hierarchy of monarch.

Every error monarch raises on purpose is a `MonarchError`; its message names what failed (op, endpoint,
rank, specs) and how to fix it. Remote failures carry the rank and the remote traceback.
"""
from __future__ import annotations


class MonarchError(Exception):
    """Base class of every error monarch raises on purpose."""


class MeshError(MonarchError, ValueError):
    """A mesh operation got bad input: an unknown dim, an out-of-range index, an impossible split."""


class ShardingError(MonarchError, ValueError):
    """Tensors with incompatible shardings, shapes or meshes met in one op, or a bad placement (a ValueError, as
    DTensor raises for those)."""


class ShapeError(ShardingError, RuntimeError):
    """An op got inputs whose global shapes or dtypes do not fit (raised on the controller, as torch would)."""


class DeviceError(ShardingError, RuntimeError):
    """Tensors on different devices met in one op, or a device the mesh does not have was asked for (raised
    on the controller, where torch would raise its RuntimeError)."""


class TraceError(MonarchError):
    """A compiled step did something that cannot be recorded once and replayed (a sync point inside it)."""


class UnsupportedOpError(MonarchError):
    """An op has no sharding rule and strict mode forbids the replicated fallback."""


class TransportError(MonarchError):
    """The control or data plane could not deliver a message (closed socket, oversize frame)."""


class SpawnError(MonarchError):
    """Worker processes could not be started; the message carries the launcher's stderr tail."""


class RemoteError(MonarchError):
    """Code raised on a worker. Carries the rank, its mesh coordinates, what ran and the traceback."""

    def __init__(self, message: str, *, rank: int = -1, coords: str = "", what: str = "",
                 remote_traceback: str = "", exc_type: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.what = what
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type

    def __reduce__(self):  # keep keyword fields across pickling (errors travel between processes)
        return (_rebuild, (type(self), self.args[0], self.rank, self.coords, self.what,
                           self.remote_traceback, self.exc_type))


class CheckpointError(MonarchError, RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (not a checkpoint, a missing key, a shape mismatch,
    a failed write); nothing was loaded, and an earlier checkpoint at that id is intact."""


class ActorError(RemoteError):
    """An actor endpoint (or the actor's ``__init__``) raised."""


class SupervisionError(MonarchError):
    """A worker process of a mesh died; every pending and later call on that mesh raises this."""

    def __init__(self, message: str, *, rank: int = -1, coords: str = "", status: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.status = status

    def __reduce__(self):
        return (_rebuild_supervision, (self.args[0], self.rank, self.coords, self.status))


def _rebuild(cls: type[RemoteError], message: str, rank: int, coords: str, what: str,
             tb: str, exc_type: str) -> RemoteError:
    return cls(message, rank=rank, coords=coords, what=what, remote_traceback=tb, exc_type=exc_type)


def _rebuild_supervision(message: str, rank: int, coords: str, status: str) -> SupervisionError:
    return SupervisionError(message, rank=rank, coords=coords, status=status)
