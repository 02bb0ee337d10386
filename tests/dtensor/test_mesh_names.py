"""DeviceMesh's names on monarch's meshes (LocalMesh here; tests/dtensor/test_api_procs.py on a ProcMesh):
sizes and names as DeviceMesh answers them, submeshes `mesh["tp"]`, the per-rank calls that raise a
MeshError naming what replaces them, and `with mesh:` as the default mesh of monarch.dtensor's calls.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from monarch import LocalMesh, MeshError, MonarchError
from monarch.dtensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh, zeros
from monarch.dtensor.device_mesh import DeviceMesh as DeviceMeshOfModule
from monarch.dtensor.device_mesh import init_device_mesh as init_of_module
from monarch.shape import SubMesh, default_mesh


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 3})


def test_a_mesh_answers_device_mesh_sizes_and_names(mesh: LocalMesh) -> None:
    assert (mesh.ndim, mesh.mesh_dim_names, mesh.shape, mesh.device_type) == (2, ("dp", "tp"), (2, 3), "cpu")
    assert (mesh.size(), mesh.size(0), mesh.size(-1), mesh.size(mesh_dim=1), mesh.size("tp")) == (6, 2, 3, 3, 3)
    assert isinstance(mesh, DeviceMesh) and isinstance(mesh["tp"], DeviceMesh)
    assert DeviceMesh is DeviceMeshOfModule and init_device_mesh is init_of_module
    with pytest.raises(MeshError, match=r"mesh dim 2 is out of range.*\('dp', 'tp'\)"):
        mesh.size(2)
    with pytest.raises(TypeError, match="not iterable"):
        iter(mesh)


def test_a_submesh_is_a_view_of_the_same_mesh_by_some_dims(mesh: LocalMesh) -> None:
    tp = mesh["tp"]
    assert isinstance(tp, SubMesh) and tp.root is mesh
    names = (tp.ndim, tp.mesh_dim_names, tp.shape, tp.size(), tp.size(0), tp.device_type)
    assert names == (1, ("tp",), (3,), 3, 3, "cpu")
    swapped = mesh["tp", "dp"]
    assert swapped.mesh_dim_names == ("tp", "dp") and swapped.shape == (3, 2)
    assert swapped["dp"] == mesh["dp"] and swapped["tp", "dp"] is swapped
    assert mesh["dp", "tp"] is mesh, "all dims in order: the mesh itself, as DeviceMesh gives"
    assert repr(tp) == "<LocalMesh {'dp': 2, 'tp': 3}>['tp']"


@pytest.mark.parametrize("key, match", [("pp", r"no dim 'pp'; the mesh's dims are \('dp', 'tp'\)"),
                                        (0, "index a mesh by dim names"), (("tp", "tp"), "at most once")])
def test_a_bad_submesh_is_refused_naming_the_dims(mesh: LocalMesh, key: Any, match: str) -> None:
    with pytest.raises(MeshError, match=match):
        mesh[key]


PER_RANK: dict[str, Callable[[Any], Any]] = {
    "get_coordinate": lambda m: m.get_coordinate(), "get_local_rank": lambda m: m.get_local_rank("tp"),
    "get_rank": lambda m: m.get_rank()}


@pytest.mark.parametrize("call", PER_RANK, ids=list(PER_RANK))
@pytest.mark.parametrize("sub", [False, True], ids=["mesh", "submesh"])
def test_per_rank_calls_raise_naming_what_replaces_them(mesh: LocalMesh, call: str, sub: bool) -> None:
    with pytest.raises(MeshError, match=rf"{call}\(\) has no meaning on a single controller") as info:
        PER_RANK[call](mesh["tp"] if sub else mesh)
    assert isinstance(info.value, MonarchError)
    for fix in ("monarch.local_map", "current_rank()", "t.redistribute(placements)"):
        assert fix in str(info.value)


def test_get_group_raises_saying_collectives_happen_by_redistributing(mesh: LocalMesh) -> None:
    with pytest.raises(MeshError, match=r"get_group\(\): a single controller has no process groups.*redistribut"):
        mesh.get_group("tp")


def test_with_mesh_makes_it_the_default_mesh_of_dtensor_calls(mesh: LocalMesh) -> None:
    other = LocalMesh({"x": 2})
    assert default_mesh() is None
    with mesh as entered:
        assert entered is mesh and default_mesh() is mesh
        with other["x"]:
            assert zeros(4, placements=[Shard(0)]).device_mesh is other
        t = distribute_tensor(torch.arange(6.0), placements=[Replicate(), Shard(0)])
        with mesh["tp"]:
            on_tp = zeros(6, placements=[Shard(0)])
    assert default_mesh() is None
    assert t.device_mesh is mesh and t.placements == (Replicate(), Shard(0))
    assert on_tp.device_mesh is mesh and on_tp.placements == (Replicate(), Shard(0))
    assert torch.equal(t.full_tensor(), torch.arange(6.0))


def test_without_a_mesh_dtensor_calls_name_the_fix() -> None:
    with pytest.raises(MeshError, match=r"distribute_tensor: no device_mesh given.*init_device_mesh.*`with mesh:`"):
        distribute_tensor(torch.ones(2))
    with pytest.raises(MeshError, match=r"zeros: device_mesh 'cpu' is not a monarch mesh.*init_device_mesh"):
        zeros(2, device_mesh="cpu")  # type: ignore[arg-type]


def test_init_device_mesh_refuses_bad_arguments_before_spawning() -> None:
    with pytest.raises(MeshError, match=r"1 mesh_dim_names \('dp',\) for mesh_shape \(2, 2\)"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
    with pytest.raises(MeshError, match="backend_override"):
        init_device_mesh("cpu", (2,), backend_override={0: "gloo"})
    with pytest.raises(MeshError, match=r"mesh=\[1, 0\].*torch.arange\(n\).reshape\(shape\)"):
        DeviceMesh("cpu", [1, 0])
