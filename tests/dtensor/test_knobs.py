"""DTensor's smaller knobs on monarch: Partial("avg") and Partial(reduce_op=...), no collective over a mesh dim of
size 1, and ShardingError as the ValueError DTensor raises for bad placements. On a LocalMesh, values against
plain torch and collectives counted with CommDebugMode."""
from __future__ import annotations

import pytest
import torch

from monarch import LocalMesh, ShardingError
from monarch.dtensor import Partial, Replicate, Shard, distribute_tensor
from monarch.dtensor.debug import CommDebugMode

funcol = torch.ops.c10d_functional


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


def test_partial_spellings_and_placement_predicates() -> None:
    assert Partial("avg") == Partial(reduce_op="avg") == Partial(op="avg") and Partial().reduce_op == "sum"
    assert Replicate().is_replicate() and not Shard(0).is_replicate() and not Partial().is_replicate()
    assert Partial("avg").is_partial() and Partial("avg").is_partial("avg") and not Partial().is_partial("avg")
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0) and not Replicate().is_partial()
    with pytest.raises(ShardingError, match="avgg"):
        Partial("avgg")


@pytest.mark.parametrize("target, kind", [((Replicate(), Replicate()), funcol.all_reduce),
                                          ((Shard(0), Replicate()), funcol.reduce_scatter_tensor)],
                         ids=["to-replicate", "to-shard"])
def test_partial_avg_reduces_to_the_mean(mesh: LocalMesh, target: tuple, kind: object) -> None:
    """A replicated value placed Partial(avg) keeps its value; pieces of a Partial(avg) average on the way out."""
    data = torch.randn(4, 6)
    t = distribute_tensor(data, mesh, [Partial("avg"), Replicate()])
    assert t.placements == (Partial("avg"), Replicate())
    with CommDebugMode() as comm:
        out = t.redistribute(target)
        got = out.full_tensor()
    torch.testing.assert_close(got, data)
    assert comm.get_total_counts() == 1 and comm.get_comm_counts()[kind] == 1
    doubled = (t * 2).redistribute([Replicate(), Replicate()]).full_tensor()  # ops on it keep the average
    torch.testing.assert_close(doubled, data * 2)


def test_no_collective_over_a_mesh_dim_of_size_one() -> None:
    mesh = LocalMesh({"dp": 1, "tp": 2})
    data = torch.randn(4, 6)
    with CommDebugMode() as comm:
        for src, dst in [([Shard(0), Replicate()], [Replicate(), Replicate()]),
                         ([Partial(), Replicate()], [Replicate(), Replicate()]),
                         ([Partial(), Replicate()], [Shard(1), Replicate()]),
                         ([Shard(0), Replicate()], [Shard(1), Replicate()])]:
            t = distribute_tensor(data, mesh, src).redistribute(dst)
            assert t.placements == tuple(dst)
            torch.testing.assert_close(t.full_tensor(), data)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    with CommDebugMode() as comm:
        distribute_tensor(data, mesh, [Replicate(), Shard(0)]).redistribute([Replicate(), Replicate()]).full_tensor()
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 1  # tp has two ranks


def test_bad_placements_raise_a_value_error(mesh: LocalMesh) -> None:
    """DTensor raises ValueError for these; ShardingError is one, so `except ValueError` keeps working."""
    assert issubclass(ShardingError, ValueError)
    with pytest.raises(ValueError, match="out of range"):
        distribute_tensor(torch.randn(4, 6), mesh, [Shard(2), Replicate()])
    with pytest.raises(ValueError, match="placements"):
        distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)] * 3)
