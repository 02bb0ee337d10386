"""DTensor's `distribute_tensor` and factories (torch.distributed.tensor's signatures) over monarch's.

A `device_mesh` is a ProcMesh or LocalMesh (placements: one per dim, or a dict by dim name), a submesh
`mesh["tp"]` (placements for its dims; the other dims Replicate), or None: the mesh of the innermost
`with mesh:` block.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from monarch.errors import MeshError, ShardingError
from monarch.runtime.session import api
from monarch.shape import DeviceMeshNames, MeshLike, SubMesh, default_mesh
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement

Placements = Sequence[Placement] | Mapping[str, Placement] | None


def resolve(device_mesh: DeviceMeshNames | None, placements: Placements, what: str
            ) -> tuple[MeshLike, Placements]:
    """The mesh a DTensor call makes its tensor on, and the placements for that mesh's dims."""
    mesh = device_mesh if device_mesh is not None else default_mesh()
    if mesh is None:
        raise MeshError(f"{what}: no device_mesh given and no `with mesh:` block is open; pass device_mesh=, or "
                        "make a mesh, mesh = monarch.dtensor.init_device_mesh('cpu', (2, 2)), and call this "
                        "inside `with mesh:`")
    if not isinstance(mesh, DeviceMeshNames):
        raise MeshError(f"{what}: device_mesh {mesh!r} is not a monarch mesh; make it with "
                        "monarch.dtensor.init_device_mesh (a torch DeviceMesh needs a process group per rank, "
                        "and a single controller drives its workers without one)")
    if isinstance(mesh, SubMesh):
        return mesh.root, mesh.placements(placements)
    return mesh, placements  # type: ignore[return-value] - a DeviceMeshNames that is no SubMesh is a MeshLike


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMeshNames | None = None,
                      placements: Placements = None, *, src_data_rank: int | None = 0) -> MeshTensor:
    """`tensor` distributed over `device_mesh` (placements default to Replicate). The controller's `tensor` is
    the one source of the data, so every `src_data_rank` gives the same result, as DTensor's default does."""
    mesh, ps = resolve(device_mesh, placements, "distribute_tensor")
    return api.distribute_tensor(tensor, mesh, ps)


def _made(t: MeshTensor, layout: torch.layout, requires_grad: bool, what: str) -> MeshTensor:
    if layout != torch.strided:
        raise ShardingError(f"monarch.dtensor.{what}(layout={layout}): MeshTensors are strided; drop layout=")
    return t.requires_grad_(requires_grad)


def zeros(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMeshNames | None = None,
          placements: Placements = None) -> MeshTensor:
    mesh, ps = resolve(device_mesh, placements, "zeros")
    return _made(api.zeros(*size, mesh=mesh, placements=ps, dtype=dtype), layout, requires_grad, "zeros")


def ones(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMeshNames | None = None,
         placements: Placements = None) -> MeshTensor:
    mesh, ps = resolve(device_mesh, placements, "ones")
    return _made(api.ones(*size, mesh=mesh, placements=ps, dtype=dtype), layout, requires_grad, "ones")


def empty(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: DeviceMeshNames | None = None,
          placements: Placements = None) -> MeshTensor:
    """Zero-filled, as monarch.empty (workers never hand out uninitialised memory)."""
    mesh, ps = resolve(device_mesh, placements, "empty")
    return _made(api.empty(*size, mesh=mesh, placements=ps, dtype=dtype), layout, requires_grad, "empty")


def full(size: Sequence[int] | int, fill_value: float, *, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMeshNames | None = None, placements: Placements = None) -> MeshTensor:
    mesh, ps = resolve(device_mesh, placements, "full")
    made = api.full(size, fill_value=fill_value, mesh=mesh, placements=ps, dtype=dtype)
    return _made(made, layout, requires_grad, "full")


def rand(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMeshNames | None = None,
         placements: Placements = None) -> MeshTensor:
    """Uniform in [0, 1), drawn from monarch.manual_seed's stream (the values do not depend on placements)."""
    mesh, ps = resolve(device_mesh, placements, "rand")
    return _made(api.rand(*size, mesh=mesh, placements=ps, dtype=dtype), layout, requires_grad, "rand")


def randn(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMeshNames | None = None,
          placements: Placements = None) -> MeshTensor:
    """Standard normal, drawn from monarch.manual_seed's stream (the values do not depend on placements)."""
    mesh, ps = resolve(device_mesh, placements, "randn")
    return _made(api.randn(*size, mesh=mesh, placements=ps, dtype=dtype), layout, requires_grad, "randn")
