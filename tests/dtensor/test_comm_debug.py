"""CommDebugMode on a LocalMesh: the collectives monarch ships inside the block, counted under DTensor's
keys (torch.ops.c10d_functional ops) and per mesh dim; ops recorded before the block are not counted,
ops recorded inside it are, even when nothing was read yet.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from monarch import LocalMesh, MeshTensor
from monarch.dtensor import Replicate, Shard, distribute_tensor
from monarch.dtensor.debug import CommDebugMode

funcol = torch.ops.c10d_functional
R = Replicate()


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


@pytest.fixture(scope="module")
def xw(mesh: LocalMesh) -> tuple[torch.Tensor, torch.Tensor, MeshTensor, MeshTensor]:
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    return a, b, distribute_tensor(a, mesh, [R, Shard(1)]), distribute_tensor(b, mesh, [R, Shard(0)])


CASES: dict[str, tuple[Callable[[MeshTensor, MeshTensor], MeshTensor], object, str, Callable]] = {
    "all_gather": (lambda x, w: x.redistribute([R, R]), funcol.all_gather_into_tensor, "all_gather",
                   lambda a, b: a),
    "all_reduce": (lambda x, w: (x @ w).redistribute([R, R]), funcol.all_reduce, "all_reduce",
                   lambda a, b: a @ b),
    "reduce_scatter": (lambda x, w: (x @ w).redistribute([R, Shard(0)]), funcol.reduce_scatter_tensor,
                       "reduce_scatter", lambda a, b: a @ b),
    "all_to_all": (lambda x, w: x.redistribute([R, Shard(0)]), funcol.all_to_all_single, "all_to_all",
                   lambda a, b: a),
}


@pytest.mark.parametrize("case", CASES)
def test_each_collective_counts_under_dtensors_key_and_its_mesh_dim(xw: tuple, case: str) -> None:
    a, b, x, w = xw
    fn, key, kind, want = CASES[case]
    with CommDebugMode() as comm:
        y = fn(x, w)
    counts = comm.get_comm_counts()
    assert comm.get_total_counts() == 1 and dict(counts) == {key: 1}
    assert comm.collectives == [f"{kind}[tp]"] and comm.get_comm_counts_by_dim() == {"tp": {kind: 1}}
    name = key._qualified_op_name.split("::")[1]
    assert counts[getattr(torch.ops._c10d_functional, name)] == 1 and counts[name] == 1, "aliases of the key"
    assert counts[funcol.broadcast] == 0, "an op not shipped counts 0, as in DTensor's defaultdict"
    assert torch.allclose(y.full_tensor(), want(a, b), atol=1e-5)


def test_only_what_is_recorded_inside_the_block_counts(xw: tuple) -> None:
    _, _, x, w = xw
    before = x.redistribute([R, R])  # recorded, not shipped yet: shipped as the block starts
    with CommDebugMode() as comm:
        local = (before * 2).sum()  # no collective: replicated inputs
    assert comm.get_total_counts() == 0 and comm.collectives == []
    with CommDebugMode() as comm:
        y = (x @ w).redistribute([R, R])
        z = y + x.redistribute([R, R]) @ w.redistribute([R, R])
    assert comm.collectives == ["all_reduce[tp]", "all_gather[tp]", "all_gather[tp]"]
    assert comm.get_comm_counts() == {funcol.all_reduce: 1, funcol.all_gather_into_tensor: 2}
    assert torch.allclose(z.full_tensor(), 2 * (xw[0] @ xw[1]), atol=1e-5) and local.item() != 0
