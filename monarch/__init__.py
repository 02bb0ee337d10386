"""monarch: one Python controller driving meshes of worker processes, actors and sharded tensors.

The actor runtime lives in `monarch.actor`; errors in `monarch.errors`; flags in `monarch.config`.
"""
from __future__ import annotations

from monarch.errors import (ActorError, MeshError, MonarchError, RemoteError, ShardingError, SpawnError,
                            SupervisionError, TransportError, UnsupportedOpError)

__version__ = "0.1.0"

__all__ = [
    "ActorError", "MeshError", "MonarchError", "RemoteError", "ShardingError", "SpawnError", "SupervisionError",
    "TransportError", "UnsupportedOpError", "__version__",
]
