"""Sharded tensors as the user sees them: placements, Spec, and `MeshTensor`.

This package imports torch and monarch.{errors,config,shape} only; it records nothing itself: a MeshTensor
hands every op to its backend (the controller-side session of its mesh).
"""
from __future__ import annotations

from monarch.tensor.meshtensor import Backend, MeshTensor
from monarch.tensor.placement import Partial, Placement, Replicate, Shard
from monarch.tensor.spec import Spec

__all__ = ["Backend", "MeshTensor", "Partial", "Placement", "Replicate", "Shard", "Spec"]
