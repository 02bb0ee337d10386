"""MeshTensors in torch's checkpoint paths: loaded optimizer state lands next to its MeshTensor parameter.

`Optimizer.load_state_dict` asks `Optimizer._process_value_according_to_param_policy` where each loaded
state tensor goes (torch: the parameter's dtype and device). `install()` extends that policy, once per
process, to MeshTensor parameters; plain parameters keep torch's policy (a MeshTensor value is gathered).
"""
from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from torch.optim import Optimizer

from monarch.tensor.meshtensor import MeshTensor


@functools.cache
def install() -> None:
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
    from monarch.runtime.tensors import distribute_tensor
    if isinstance(t, MeshTensor):  # already on the parameter's mesh
        return t if whole else t.redistribute(param.placements)
    return distribute_tensor(t, param.mesh, None if whole else param.placements)
