"""monarch: one Python controller driving meshes of worker processes, actors and sharded tensors.

The actor runtime lives in `monarch.actor`; errors in `monarch.errors`; flags in `monarch.config`.
The sharded-tensor API below loads torch and the compiler on first use, so that importing monarch
(as every worker does) stays cheap.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from monarch.errors import (ActorError, CheckpointError, DeviceError, MeshError, MonarchError, RemoteError,
                            ShapeError, ShardingError, SpawnError, SupervisionError, TraceError, TransportError,
                            UnsupportedOpError)

if TYPE_CHECKING:  # what _LAZY loads on first use, visible to type checkers and IDEs (names in __all__)
    from monarch.graph.rules.table import register_rule  # noqa: F401
    from monarch.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,  # noqa: F401
                                  data_parallel, full_state_dict, parallelize_module)
    from monarch.runtime.actors.proc_mesh import debug, sql  # noqa: F401
    from monarch.runtime.session.api import (arange, distribute_tensor, empty, explain, fetch, full,  # noqa: F401
                                             ones, rand, randint, randn, synchronize, zeros)
    from monarch.runtime.session.compile import compile  # noqa: F401, A004 - the public name is monarch.compile
    from monarch.runtime.session.local import LocalMesh  # noqa: F401
    from monarch.runtime.session.local_map import local_map  # noqa: F401
    from monarch.tensor import MeshTensor, Partial, Placement, Replicate, Shard  # noqa: F401
    from monarch.tensor.random import manual_seed  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "MeshTensor": "monarch.tensor", "Shard": "monarch.tensor", "Replicate": "monarch.tensor",
    "Partial": "monarch.tensor", "Placement": "monarch.tensor",
    "register_rule": "monarch.graph.rules.table", "compile": "monarch.runtime.session.compile",
    "manual_seed": "monarch.tensor.random", "sql": "monarch.runtime.actors.proc_mesh",
    "debug": "monarch.runtime.actors.proc_mesh", "LocalMesh": "monarch.runtime.session.local",
    **{name: "monarch.runtime.session.api" for name in (
        "distribute_tensor", "randn", "rand", "randint", "zeros", "ones", "full", "empty", "arange",
        "fetch", "synchronize", "explain")},
    "local_map": "monarch.runtime.session.local_map",
    **dict.fromkeys(("parallelize_module", "data_parallel", "full_state_dict", "ParallelStyle", "ColwiseParallel",
                     "RowwiseParallel", "SequenceParallel"), "monarch.parallel"),
}

__all__ = [
    "ActorError", "CheckpointError", "DeviceError", "MeshError", "MonarchError", "RemoteError", "ShapeError",
    "ShardingError", "SpawnError", "SupervisionError", "TraceError", "TransportError", "UnsupportedOpError",
    "__version__", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
