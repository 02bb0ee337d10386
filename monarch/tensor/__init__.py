"""Sharded tensors as the user sees them: placements, Spec, and `MeshTensor`.

This package imports torch and monarch.{errors,config,shape} only; it records nothing itself: a MeshTensor
hands every op to its backend (the controller-side session of its mesh). Its names load on first use, so that
a worker importing `monarch.tensor.placement` (the collectives' piece arithmetic) does not load the MeshTensor
machinery (torch's dynamo among it: seconds of CPU per process).
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monarch.tensor.meshtensor import Backend, MeshTensor  # noqa: F401
    from monarch.tensor.placement import Partial, Placement, Replicate, Shard  # noqa: F401
    from monarch.tensor.spec import Spec  # noqa: F401

_LAZY = {"Backend": "monarch.tensor.meshtensor", "MeshTensor": "monarch.tensor.meshtensor",
         **dict.fromkeys(("Partial", "Placement", "Replicate", "Shard"), "monarch.tensor.placement"),
         "Spec": "monarch.tensor.spec"}

__all__ = ["Backend", "MeshTensor", "Partial", "Placement", "Replicate", "Shard", "Spec"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch.tensor' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
