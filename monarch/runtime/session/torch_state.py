"""MeshTensors in torch's checkpoint paths: loaded optimizer state lands next to its MeshTensor parameter,
and torch.save refuses MeshTensors before it opens its target.

`Optimizer.load_state_dict` asks `Optimizer._process_value_according_to_param_policy` where each loaded
state tensor goes (torch: the parameter's dtype and device). `install()` extends that policy, once per
process, to MeshTensor parameters; plain parameters keep torch's policy (a MeshTensor value is gathered).
torch.save opens (and truncates) its file before it pickles anything and offers no hook before that, so
`install()` also wraps torch.save with a check of the object, and removes what it wrote if pickling
still meets a MeshTensor (one inside an arbitrary object).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from monarch.errors import MonarchError, ShardingError
from monarch.shape import MeshLike
from monarch.tensor.meshtensor import MeshTensor

Distribute = Callable[[torch.Tensor, MeshLike, Any], MeshTensor]  # monarch.distribute_tensor
_distribute: list[Distribute] = []  # handed in by the tensor API, which sits above this module


def install(distribute: Distribute) -> None:
    """Extend torch's load policy and guard torch.save, once per process."""
    if not _distribute:
        _distribute.append(distribute)
        _extend_load_policy()
        _guard_save()


def _extend_load_policy() -> None:
    """Wrap torch's policy: torch has no process-wide load_state_dict hook, and a per-optimizer hook
    cannot be registered on an optimizer monarch never sees before its user calls load_state_dict."""
    torch_policy = Optimizer._process_value_according_to_param_policy

    def policy(param: torch.Tensor, value: torch.Tensor, param_id: int, param_groups: list[dict[Any, Any]],
               key: Hashable = None) -> torch.Tensor:
        if isinstance(value, MeshTensor) and not on_mesh_of(value, param):
            value = value.full_tensor()
        out = torch_policy(param, value, param_id, param_groups, key)
        if not isinstance(param, MeshTensor):
            return out
        if key == "step":
            return out if isinstance(out, MeshTensor) or not _capturable(param_id, param_groups) else \
                _place(out.to(torch.float32), param, whole=True)
        return _place(out, param, whole=out.shape != param.shape)
    Optimizer._process_value_according_to_param_policy = staticmethod(policy)  # type: ignore[method-assign]


def on_mesh_of(value: MeshTensor, param: torch.Tensor) -> bool:
    return isinstance(param, MeshTensor) and value._backend is param._backend


def _capturable(param_id: int, param_groups: list[dict[Any, Any]]) -> bool:
    """Whether torch keeps this parameter's `step` with the parameter (capturable or fused Adam); a
    MeshTensor parameter's is then a replicated MeshTensor, as monarch.compile makes it."""
    return any(g.get("capturable", False) or g.get("fused", False) for g in param_groups if param_id in g["params"])


def _place(t: torch.Tensor, param: MeshTensor, whole: bool) -> MeshTensor:
    """`t` on the parameter's mesh: replicated when `whole`, else with the parameter's placements."""
    if isinstance(t, MeshTensor):  # already on the parameter's mesh
        return t if whole else t.redistribute(param.placements)
    return _distribute[0](t, param.mesh, None if whole else param.placements)


def _guard_save() -> None:
    torch_save = torch.save

    @functools.wraps(torch_save)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        where = _mesh_tensor_in(obj, "obj", set())
        if where is not None:
            raise ShardingError(f"torch.save(obj, ...): {where} is a MeshTensor, whose data lives on the workers; "
                                "checkpoint with monarch.checkpoint.save(state_dict, checkpoint_id=...) (each worker "
                                "writes its pieces), or save monarch.full_state_dict(model or optimizer) (or "
                                "t.full_tensor() of a tensor) to gather it here. Nothing was written")
        path = isinstance(f, (str, os.PathLike))
        start = f.tell() if not path and getattr(f, "seekable", lambda: False)() else None
        try:
            return torch_save(obj, f, *args, **kwargs)
        except MonarchError:  # a MeshTensor met while pickling, after torch opened f
            if path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)
            elif start is not None:
                f.seek(start)
                f.truncate()
            raise
    torch.save = torch.serialization.save = save


def _mesh_tensor_in(obj: Any, where: str, seen: set[int]) -> str | None:
    """Where in `obj`, through dicts, sequences, sets and modules' state, a MeshTensor sits (None: nowhere)."""
    if isinstance(obj, MeshTensor):
        return where
    if isinstance(obj, torch.Tensor) or id(obj) in seen:
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = enumerate(obj)
    elif isinstance(obj, nn.Module):
        items = obj.state_dict(keep_vars=True).items()
    else:
        return None
    seen.add(id(obj))
    return next((hit for k, v in items if (hit := _mesh_tensor_in(v, f"{where}[{k!r}]", seen)) is not None), None)
