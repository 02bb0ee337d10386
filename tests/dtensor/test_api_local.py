"""monarch.dtensor's distribute_tensor and factories with DTensor's signatures, on a LocalMesh: values
against plain torch, placements on a whole mesh and on submeshes (Replicate over the other dims), and
the DTensor names that are monarch's own objects.
"""
from __future__ import annotations

import pytest
import torch

import monarch
import monarch.parallel
from monarch import LocalMesh, MeshError, ShardingError
from monarch.dtensor import (DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor,
                             empty, full, ones, rand, randn, zeros)

R = Replicate()


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


def test_dtensor_names_are_monarchs_objects() -> None:
    assert DTensor is monarch.MeshTensor and distribute_module is monarch.parallel.distribute_module
    assert (Shard, Replicate, Partial) == (monarch.Shard, monarch.Replicate, monarch.Partial)
    assert Placement is monarch.Placement


@pytest.mark.parametrize("sub, placements, expected", [
    ((), [Shard(0), Shard(1)], (Shard(0), Shard(1))),
    ((), {"tp": Shard(1)}, (R, Shard(1))),
    (("tp",), [Shard(0)], (R, Shard(0))),
    (("dp",), [Shard(1)], (Shard(1), R)),
    (("tp", "dp"), [Shard(0), Shard(1)], (Shard(1), Shard(0))),
    (("tp",), None, (R, R)),
], ids=["mesh", "mesh-dict", "tp", "dp", "tp-dp", "tp-default"])
def test_distribute_tensor_on_a_mesh_or_submesh(mesh: LocalMesh, sub: tuple[str, ...], placements: object,
                                                expected: tuple) -> None:
    data = torch.randn(4, 6)
    t = distribute_tensor(data, mesh[sub] if sub else mesh, placements, src_data_rank=None)
    assert isinstance(t, DTensor) and t.device_mesh is mesh and t.placements == expected
    assert torch.equal(t.full_tensor(), data)
    assert torch.allclose((t @ t.T).full_tensor(), data @ data.T, atol=1e-5)


def test_placements_that_do_not_fit_a_submesh_are_refused(mesh: LocalMesh) -> None:
    with pytest.raises(MeshError, match=r"2 placements for .*\['tp'\], which has dims \('tp',\): give one per dim"):
        distribute_tensor(torch.ones(4), mesh["tp"], [Shard(0), R])
    with pytest.raises(MeshError, match=r"placements name \['dp'\], which .*\['tp'\] does not address"):
        distribute_tensor(torch.ones(4), mesh["tp"], {"dp": Shard(0)})


def test_factories_take_dtensors_signatures(mesh: LocalMesh) -> None:
    shard = [Shard(0), Shard(1)]
    made = {
        "zeros": (zeros(4, 6, device_mesh=mesh, placements=shard), torch.zeros(4, 6)),
        "ones": (ones((4, 6), dtype=torch.float64, device_mesh=mesh["tp"], placements=[Shard(1)]),
                 torch.ones(4, 6, dtype=torch.float64)),
        "empty": (empty(torch.Size([4, 6]), device_mesh=mesh, placements=shard), torch.zeros(4, 6)),
        "full": (full((4, 6), 2.5, device_mesh=mesh, placements=shard), torch.full((4, 6), 2.5)),
        "full int": (full([3], 7, device_mesh=mesh), torch.full([3], 7)),
    }
    for what, (t, want) in made.items():
        assert t.device_mesh is mesh and t.dtype == want.dtype and not t.requires_grad, what
        assert torch.equal(t.full_tensor(), want), what
    assert made["ones"][0].placements == (R, Shard(1))


def test_random_factories_draw_the_same_values_whatever_the_placements(mesh: LocalMesh) -> None:
    for factory in (rand, randn):
        monarch.manual_seed(3)
        sharded = factory(4, 6, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        monarch.manual_seed(3)
        whole = factory(4, 6, device_mesh=mesh["tp"])
        assert sharded.shape == (4, 6) and whole.placements == (R, R)
        assert torch.equal(sharded.full_tensor(), whole.full_tensor())
    assert rand(8, dtype=torch.float64, device_mesh=mesh).dtype == torch.float64
    assert 0 <= rand(8, device_mesh=mesh).full_tensor().min() < 1


def test_requires_grad_makes_a_leaf_that_gets_gradients(mesh: LocalMesh) -> None:
    w = ones(4, 6, requires_grad=True, device_mesh=mesh, placements=[Shard(0), R])
    assert w.requires_grad and w.is_leaf
    (w * torch.arange(6.0)).sum().backward()
    assert w.grad is not None and torch.equal(w.grad.full_tensor(), torch.arange(6.0).expand(4, 6))


def test_a_sparse_layout_is_refused(mesh: LocalMesh) -> None:
    with pytest.raises(ShardingError, match=r"zeros\(layout=torch.sparse_coo\): MeshTensors are strided"):
        zeros(4, layout=torch.sparse_coo, device_mesh=mesh)
