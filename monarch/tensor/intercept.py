"""The order in which an op on MeshTensors meets monarch's tables, from `torch.relu(x)` to a recorded node.

1. Torch-function wholes (`ops.WHOLE`): `MeshTensor.__torch_function__` calls `torch_function`, before
   autograd and before torch decomposes a composite op. F.linear, multi-head attention and `x[i] = v`
   along a shard are taken whole here; ops reading an index tensor's values in C++ (`tensor_split`)
   get those values first. Anything else (torch.relu) runs as plain torch; autograd records it, and
   each aten op it reaches (`aten.relu.default`) comes to `MeshTensor.__torch_dispatch__`, which finds
   the one backend of its MeshTensor arguments (the session of their mesh) and calls `dispatch`:
2. Data-dependent rewrites (`data_dependent.REWRITES`): nonzero, x[mask], unique... read the few numbers
   that fix their output shape (a sync point) and re-enter as ops of known shapes.
3. Generator ops: an op given the user's torch.Generator runs on the controller (`Stages.with_generator`).
4. Decompositions (`Stages.decomposition`: graph/decompose.py, graph/norms.py): an op without a sharding
   rule runs as simpler ops that have one; each of them re-enters at step 2.
5. An op that returns no tensor (`bool(t)`) is a sync point (`Stages.on_values`); every other
   op is recorded (`Stages.record`: graph/trace.py), its placements decided by the sharding rules
   (graph/rules/table.py `RULES`, through graph/propagate.py) as it becomes a node of the pending graph.

This module sits with MeshTensor because torch hands control over here and tensor/ may not import graph
or runtime: steps 3 to 5 are reached through the `Stages` protocol (part of MeshTensor's `Backend`),
which the session implements with the graph's decompositions and tracer.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from monarch.tensor import data_dependent, dynamo
from monarch.tensor.data_dependent import whole
from monarch.tensor.device import gpu_named, made_then_moved
from monarch.tensor.ops import READS_DATA, WHOLE

Op = torch._ops.OpOverload


class Stages(Protocol):
    """Steps 3 to 5 as the backend of a mesh provides them (the session, with the graph's tables)."""

    def with_generator(self, func: Op, args: tuple, kwargs: dict) -> Any:
        """Step 3: run `func` on the controller with the user's generator, on the fetched inputs."""

    def decomposition(self, func: Op) -> Callable[..., Any] | None:
        """Step 4: how to run `func` as simpler ops, or None when it is recorded as it is."""

    def on_values(self, func: Op, args: tuple, kwargs: dict) -> Any:
        """Step 5, no tensor returned: a sync point, `func` run on the fetched inputs."""

    def record(self, func: Op, args: tuple, kwargs: dict) -> Any:
        """Step 5: a node of the pending graph, placed by the sharding rules; its MeshTensors."""


def torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """Step 1: `func` taken whole when it applies, else run as plain torch (its results not wrapped again)."""
    if torch.compiler.is_compiling():
        dynamo.refuse_one_graph()
    if gpu_named(kwargs) and func not in WHOLE and not isinstance(func, torch._ops.OpOverload):
        return made_then_moved(func, args, kwargs, torch_function)
    if func in WHOLE:
        out = WHOLE[func](*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func in READS_DATA:
        args, kwargs = (args[0], *whole(args[1:])), whole(kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def dispatch(backend: Stages, func: Op, args: tuple, kwargs: dict) -> Any:
    """Steps 2 to 5 for one aten op on MeshTensors of `backend`'s mesh."""
    plain = _plain(func)
    if not plain:
        done, out = data_dependent.rewrite(func, args, kwargs)
        if done:
            return out
        if _generator(func, args, kwargs) is not None:
            return backend.with_generator(func, args, kwargs)
    parts = backend.decomposition(func)
    if parts is not None:
        return parts(*args, **kwargs)
    if not plain and not _returns_tensors(func):
        return backend.on_values(func, args, kwargs)
    return backend.record(func, args, kwargs)


@functools.cache
def _plain(func: Op) -> bool:
    """Whether steps 2, 3 and 5's sync point can never apply to `func` (most ops): no data-dependent rewrite,
    no generator argument, tensors returned."""
    return not data_dependent.rewrites(func) and _generator_slot(func) is None and _returns_tensors(func)


def _generator(func: Op, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The torch.Generator an op was given (by keyword, or by position as torch.poisson's)."""
    slot = _generator_slot(func)
    if slot is None:
        return None
    i, name = slot
    return args[i] if i < len(args) else kwargs.get(name)


@functools.cache
def _generator_slot(func: Op) -> tuple[int, str] | None:
    return next(((i, a.name) for i, a in enumerate(func._schema.arguments) if "Generator" in str(a.type)), None)


@functools.cache
def _returns_tensors(func: Op) -> bool:
    return any("Tensor" in str(r.type) for r in func._schema.returns)
