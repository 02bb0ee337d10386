"""The local/global boundary with DTensor's names, on a LocalMesh and on a real 2x2 proc mesh: full_tensor,
to_local and from_local, redistribute's DTensor arguments and experimental.local_map, each with values and
gradients against plain torch (the pieces' gradients are the chain rule's), and the placements and
collectives of the gradients.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

import monarch
from monarch import LocalMesh, ShardingError
from monarch.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from monarch.dtensor.debug import CommDebugMode
from monarch.dtensor.experimental import local_map
from monarch.runtime.control.futures import ValueMesh
from monarch.shape import DeviceMeshNames

T = 60.0  # seconds any single wait may take
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


@pytest.fixture(scope="module", params=["local", "procs"])
def mesh(request: pytest.FixtureRequest) -> Iterator[DeviceMeshNames]:
    if request.param == "local":
        yield LocalMesh({"dp": 2, "tp": 2})
        return
    m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    yield m
    m.stop()


def leaf(data: torch.Tensor, mesh: DeviceMeshNames, placements: list) -> DTensor:
    return distribute_tensor(data, mesh, placements).requires_grad_()


def pieces_of(data: torch.Tensor, placements: list) -> list[torch.Tensor]:
    """Plain torch's pieces of `data` on a 2x2 mesh (Shard: torch.chunk, Replicate: the whole), rank order."""
    out = []
    for dp in range(2):
        for tp in range(2):
            piece = data
            for p, c in zip(placements, (dp, tp), strict=True):
                if isinstance(p, Shard):
                    piece = piece.chunk(2, p.dim)[c]
            out.append(piece)
    return out


@pytest.mark.parametrize("placements, grad_placements, grad_is", [
    ([S0, R], None, (S0, R)),
    ([P, S1], None, (R, S1)),
    ([S0, R], [P, R], (S0, R)),
], ids=["shard", "partial-gets-replicate", "grad-partial"])
def test_full_tensor_is_differentiable(mesh: DeviceMeshNames, placements: list, grad_placements: list | None,
                                       grad_is: tuple) -> None:
    x, w = torch.randn(4, 6), torch.randn(4, 6)
    X = leaf(x, mesh, placements)
    whole = X.full_tensor(timeout=T, grad_placements=grad_placements)
    assert torch.allclose(whole, x, atol=1e-6) and whole.grad_fn is not None
    with CommDebugMode() as comm:
        (whole * whole * w).sum().backward()
    assert X.grad.placements == grad_is
    assert torch.allclose(X.grad.full_tensor(timeout=T), 2 * x * w, atol=1e-5)
    if grad_placements is not None:  # placed Partial on dp, then reduce-scattered to the tensor's S(0)
        assert comm.collectives == ["reduce_scatter[dp]"]
    with torch.no_grad():
        assert X.full_tensor(timeout=T).grad_fn is None


def test_redistribute_takes_dtensors_arguments(mesh: DeviceMeshNames) -> None:
    x = torch.randn(4, 6)
    X = distribute_tensor(x, mesh, [S0, R])
    assert X.redistribute(mesh, [S0, S1]).placements == (S0, S1)
    assert X.redistribute(mesh["tp"], [S1]).placements == (R, S1)
    assert X.redistribute(placements=[R, S0], async_op=True).placements == (R, S0)
    assert X.redistribute({"tp": S1}).placements == (R, S1) and X.redistribute([S0, R]) is X
    assert torch.equal(X.redistribute(mesh, [S1, S0]).full_tensor(timeout=T), x)
    with pytest.raises(ShardingError, match="not the tensor's mesh"):
        X.redistribute(LocalMesh({"dp": 2, "tp": 2}), [R, R])
    with pytest.raises(ShardingError, match="placements given twice"):
        X.redistribute([R, R], [R, R])


def test_redistribute_forward_and_backward_dtypes(mesh: DeviceMeshNames) -> None:
    x, w = torch.randn(4, 6), torch.randn(4, 6, dtype=torch.float64)
    X = leaf(x, mesh, [S0, R])
    Y = X.redistribute(mesh, [R, R], forward_dtype=torch.float64)
    assert Y.dtype == torch.float64 and torch.equal(Y.full_tensor(timeout=T), x.double())
    (Y * distribute_tensor(w, mesh)).sum().full_tensor(timeout=T).backward()
    assert X.grad.dtype == torch.float32 and X.grad.placements == (S0, R)  # back to X's placements and dtype
    assert torch.equal(X.grad.full_tensor(timeout=T), w.float())
    X.grad = None
    Y = X.redistribute(mesh, [R, R], backward_dtype=torch.bfloat16)
    assert Y.dtype == torch.float32
    (Y * distribute_tensor(w.float(), mesh)).sum().full_tensor(timeout=T).backward()
    assert X.grad.dtype == torch.float32 and torch.equal(X.grad.full_tensor(timeout=T), w.bfloat16().float())


def test_to_local_gives_each_ranks_piece_and_their_gradients(mesh: DeviceMeshNames) -> None:
    x = torch.randn(4, 6)
    X = leaf(x, mesh, [S0, R])
    local = X.to_local()
    assert isinstance(local, ValueMesh) and dict(local.extent) == {"dp": 2, "tp": 2}
    for got, want in zip(local.values(), pieces_of(x, [S0, R]), strict=True):
        assert torch.equal(got.detach(), want)
    assert torch.equal(local.item(dp=1, tp=0).detach(), x[2:])
    scale = [1.0, 2.0, 3.0, 4.0]
    sum((p * k).sum() for p, k in zip(local.values(), scale, strict=True)).backward()
    ref = x.clone().requires_grad_()
    sum((p * k).sum() for p, k in zip(pieces_of(ref, [S0, R]), scale, strict=True)).backward()
    assert X.grad.placements == (S0, P)  # the Replicate copies' gradients add up, as in plain torch
    assert torch.equal(X.grad.full_tensor(timeout=T), ref.grad)
    X.grad = None
    one = X.to_local(grad_placements=[S0, R])  # DTensor's assumption: the copies' gradients agree
    sum(p.sum() for p in one.values()).backward()
    assert X.grad.placements == (S0, R) and torch.equal(X.grad.full_tensor(timeout=T), torch.ones(4, 6))
    with pytest.raises(ShardingError, match="pieces of other shapes"):
        X.to_local(grad_placements=[R, R])


def test_from_local_of_a_list_a_value_mesh_and_one_tensor(mesh: DeviceMeshNames) -> None:
    parts = [torch.randn(2, 3, requires_grad=True) for _ in range(4)]
    X = DTensor.from_local(parts, mesh, [S0, P])
    whole = torch.cat([parts[0] + parts[1], parts[2] + parts[3]])
    assert X.shape == (4, 3) and X.placements == (S0, P)
    assert torch.allclose(X.full_tensor(timeout=T), whole.detach(), atol=1e-6)
    w = torch.randn(4, 3)
    (X * distribute_tensor(w, mesh)).sum().full_tensor(timeout=T).backward()
    ref = [p.detach().clone().requires_grad_() for p in parts]
    (torch.cat([ref[0] + ref[1], ref[2] + ref[3]]) * w).sum().backward()
    for got, want in zip(parts, ref, strict=True):
        assert torch.allclose(got.grad, want.grad, atol=1e-6)
    back = DTensor.from_local(X.to_local(), mesh, X.placements)
    assert torch.allclose(back.full_tensor(timeout=T), whole.detach(), atol=1e-6)
    one = torch.randn(2, 3, requires_grad=True)
    Y = DTensor.from_local(one, mesh, [S0, R])  # the same piece on every rank: cat(one, one)
    assert torch.equal(Y.full_tensor(timeout=T), torch.cat([one, one]).detach())
    (Y * distribute_tensor(w, mesh)).sum().full_tensor(timeout=T).backward()
    assert torch.allclose(one.grad, w[:2] + w[2:], atol=1e-6)
    Z = DTensor.from_local(one.detach(), mesh["tp"], [S1])
    assert Z.placements == (R, S1) and torch.equal(Z.full_tensor(timeout=T), torch.cat([one, one], 1).detach())


def test_from_local_uneven_pieces_and_run_check(mesh: DeviceMeshNames) -> None:
    x = torch.randn(5, 3)
    uneven = pieces_of(x, [S0, R])
    with pytest.raises(ShardingError, match="pass shape="):
        DTensor.from_local(uneven, mesh, [S0, R])
    X = DTensor.from_local(uneven, mesh, [S0, R], shape=(5, 3), stride=(3, 1), run_check=True)
    assert torch.equal(X.full_tensor(timeout=T), x)
    bad = [torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ShardingError, match=r"rank 1 \(0, 1\) differs from rank 0"):
        DTensor.from_local(bad, mesh, [R, R], run_check=True)
    with pytest.raises(ShardingError, match="3 pieces"):
        DTensor.from_local(bad[:3], mesh, [R, R])


def test_local_map_in_dtensors_order(mesh: DeviceMeshNames) -> None:
    x = torch.randn(4, 6)
    X = distribute_tensor(x, mesh, [S0, R])

    @functools.partial(local_map, out_placements=([S0, R], None), in_placements=([S0, R], None))
    def scaled(a: torch.Tensor, k: float) -> tuple[torch.Tensor, int]:
        return a * k, a.shape[0]
    Y, rows = scaled(X, 3.0)
    assert rows == 2 and Y.placements == (S0, R) and torch.allclose(Y.full_tensor(timeout=T), 3 * x)
    assert scaled(x, 2.0)[1] == 4  # no MeshTensor: func itself
    strict = local_map(lambda a: a + 1, [R, R], [[R, R]], device_mesh=mesh)
    with pytest.raises(ValueError, match="redistribute_inputs=True"):
        strict(X)
    loose = local_map(lambda a: a + 1, [R, R], [[R, R]], device_mesh=mesh, redistribute_inputs=True)
    assert torch.allclose(loose(X).full_tensor(timeout=T), x + 1)
    with pytest.raises(ShardingError, match="tensors of two meshes"):
        local_map(torch.add, [R, R])(X, distribute_tensor(x, LocalMesh({"dp": 2, "tp": 2})))


@pytest.mark.parametrize("in_grad, expected", [(None, 8.0), ([[R, R]], 2.0)], ids=["default", "honoured"])
def test_local_map_in_grad_placements(mesh: DeviceMeshNames, in_grad: list | None, expected: float) -> None:
    X = leaf(torch.randn(2, 3), mesh, [R, R])
    double = local_map(lambda a: a * 2, [P, P], [[R, R]], in_grad, mesh)  # a Partial sum over 4 ranks: 8x
    Y = double(X)
    assert torch.allclose(Y.full_tensor(timeout=T), 8 * X.full_tensor(timeout=T).detach())
    Y.full_tensor(timeout=T).sum().backward()
    assert X.grad.placements == ((P, P) if in_grad is None else (R, R))
    assert torch.equal(X.grad.full_tensor(timeout=T), torch.full((2, 3), expected))


def test_monarch_names_stay() -> None:
    assert DTensor is monarch.MeshTensor and callable(monarch.local_map)
