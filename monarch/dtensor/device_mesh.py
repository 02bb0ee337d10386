"""`init_device_mesh` and `DeviceMesh` (torch.distributed.device_mesh's names): a mesh is a ProcMesh.

init_device_mesh spawns worker processes on this host, one per point of `mesh_shape`; its mesh behaves
as DTensor's: `with mesh:` makes it the default mesh and leaves it running (it stops at `mesh.stop()` or
at interpreter exit). `isinstance(m, DeviceMesh)` holds for ProcMesh, LocalMesh and their submeshes.
"""
from __future__ import annotations

from abc import ABCMeta
from collections.abc import Sequence

import torch

from monarch.errors import MeshError
from monarch.runtime.actors.host_mesh import this_host
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.shape import DeviceMeshNames


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                     mesh_dim_names: tuple[str, ...] | None = None, backend_override: object = None) -> ProcMesh:
    """A new ProcMesh of `mesh_shape` workers on this host, its dims named `mesh_dim_names` (default dim0,
    dim1, ...), its tensors on `device_type` ("cpu", or "cuda": a GPU per worker)."""
    shape = tuple(int(n) for n in mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise MeshError(f"init_device_mesh: {len(names)} mesh_dim_names {names} for mesh_shape {shape}; give one "
                        "name per dim")
    if backend_override is not None:
        raise MeshError("init_device_mesh(backend_override=...): monarch picks its transports itself (MPI, NCCL "
                        "for cuda meshes); drop backend_override")
    kind = torch.device(device_type).type
    procs = this_host().spawn_procs(per_host=dict(zip(names, shape, strict=True)), device=kind)
    return procs.keep_after_with()


class DeviceMesh(metaclass=ABCMeta):
    """The type of monarch's meshes under DTensor's name: ProcMesh, LocalMesh and submeshes `mesh["tp"]` are
    instances. `DeviceMesh(device_type, mesh)` spawns, as init_device_mesh, the workers of `mesh`, which
    must number them row-major (torch.arange(n).reshape(shape)): monarch starts its own processes."""

    def __new__(cls, device_type: str, mesh: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], *,
                mesh_dim_names: tuple[str, ...] | None = None) -> ProcMesh:  # type: ignore[misc]
        ranks = torch.as_tensor(mesh)
        if not torch.equal(ranks.flatten(), torch.arange(ranks.numel())):
            raise MeshError(f"DeviceMesh(device_type, mesh={ranks.tolist()}): monarch starts the mesh's processes "
                            "itself and numbers them row-major, so mesh must be torch.arange(n).reshape(shape); "
                            "or call init_device_mesh(device_type, shape)")
        return init_device_mesh(device_type, tuple(ranks.shape), mesh_dim_names=mesh_dim_names)


DeviceMesh.register(DeviceMeshNames)
