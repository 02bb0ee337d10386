"""monarch.dtensor on real worker processes: a 2x2 mesh from init_device_mesh (default dim names) that
outlives its `with` blocks, tensors on it and on its submeshes against plain torch with their collectives
counted by CommDebugMode, and a spawn_procs mesh whose `with` block stops it, after which using its
tensors raises an error that says so and names the fixes.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from monarch import MeshError, SupervisionError
from monarch.actor import ProcMesh, this_host
from monarch.dtensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh, ones, zeros
from monarch.dtensor.debug import CommDebugMode

T = 60.0  # seconds any single wait may take (the workers load torch on the first tensor op)
R = Replicate()


@pytest.fixture(scope="module")
def mesh() -> Iterator[ProcMesh]:
    m = init_device_mesh("cpu", (2, 2))
    yield m
    m.stop()


def test_init_device_mesh_spawns_a_proc_mesh_with_dtensors_names(mesh: ProcMesh) -> None:
    assert isinstance(mesh, ProcMesh) and isinstance(mesh, DeviceMesh) and mesh.running
    names = (mesh.mesh_dim_names, mesh.shape, mesh.ndim, mesh.size(), mesh.device_type)
    assert names == (("dim0", "dim1"), (2, 2), 2, 4, "cpu")
    with pytest.raises(MeshError, match=r"ProcMesh.get_rank\(\) has no meaning on a single controller"):
        mesh.get_rank()


def test_a_tensor_on_a_submesh_is_replicate_over_the_other_dims(mesh: ProcMesh) -> None:
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    with CommDebugMode() as comm:
        x = distribute_tensor(a, mesh["dim1"], [Shard(1)])
        w = distribute_tensor(b, mesh["dim1"], [Shard(0)])
        y = (x @ w).redistribute([R, R])
    assert x.placements == (R, Shard(1)) and w.placements == (R, Shard(0)) and x.device_mesh is mesh
    assert comm.collectives == ["all_reduce[dim1]"]
    assert comm.get_comm_counts() == {torch.ops.c10d_functional.all_reduce: 1}
    assert torch.allclose(y.full_tensor(timeout=T), a @ b, atol=1e-5)
    assert torch.equal(x.full_tensor(timeout=T), a)


def test_with_a_mesh_from_init_device_mesh_sets_the_default_and_keeps_it_running(mesh: ProcMesh) -> None:
    with mesh:
        z = zeros(4, 2, placements=[Shard(0), Shard(1)])
        o = ones(4, 2, device_mesh=mesh["dim0"], placements=[Shard(0)])
    assert mesh.running, "DTensor's `with mesh:` only sets the default mesh"
    assert z.device_mesh is mesh and z.placements == (Shard(0), Shard(1)) and o.placements == (Shard(0), R)
    assert torch.equal((z + o).full_tensor(timeout=T), torch.ones(4, 2))


def test_a_spawn_procs_mesh_stopped_by_its_with_block_says_so() -> None:
    with this_host().spawn_procs(per_host={"x": 1}, name="scoped") as procs:
        t = ones(3, placements=[Shard(0)])  # recorded on procs, the default mesh inside its block
    assert t.device_mesh is procs and not procs.running
    with pytest.raises(SupervisionError, match=r"'scoped' was stopped at the end of its `with` block") as info:
        t.full_tensor(timeout=T)
    assert "init_device_mesh" in str(info.value) and "procs.stop()" in str(info.value)
