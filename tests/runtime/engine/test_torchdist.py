"""Collectives through torch.distributed (gloo on CPU, the code path NCCL takes for CUDA tensors): on bare ranks
against the MPI transport (torchdist_check.py, 2 and 4 ranks); on a 2x2 mesh run with MONARCH_COLLECTIVES=torch,
every collective kind on uneven shards of several dtypes and on empty ones, random redistributions, a compiled
training step's bucketed all_reduce and a DCP checkpoint saved and resumed on views of the mesh, each equal to
plain torch, with the collectives table naming torch-gloo as what ran.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, tensor_shapes
from test_shm import DTYPES, T, check, integral, now_us

import monarch
from monarch import Replicate, Shard
from monarch.actor import ProcMesh, this_host
from tests.checkpoint.ckpt_runs import batches, build, losses, resume, stepper

CHECK = Path(__file__).with_name("torchdist_check.py")
KINDS = {"all_gather", "all_to_all", "all_reduce", "reduce_scatter"}
pytestmark = pytest.mark.filterwarnings("ignore:monarch. .* has no sharding rule",
                                        "ignore:torch.distributed is disabled")


@pytest.mark.parametrize("ranks", [2, 4])
def test_torch_transport_equals_mpi_on_random_collectives(ranks: int) -> None:
    check(ranks, script=CHECK)


@pytest.fixture(scope="module")
def mesh() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}, env={"MONARCH_COLLECTIVES": "torch"}) as p:
        yield p


def ran(mesh: ProcMesh, since: int) -> dict[str, set[str]]:
    """The collectives since `since` (µs): their transports by kind."""
    out: dict[str, set[str]] = {}
    for kind, transport in mesh.sql(f"SELECT DISTINCT kind, transport FROM collectives WHERE mesh = '{mesh.name}' "
                                    f"AND start_us >= {since}"):
        out.setdefault(kind, set()).add(transport)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64], ids=str)
def test_every_kind_on_uneven_shards(mesh: ProcMesh, dtype: torch.dtype) -> None:
    """5 x 7 over dp x tp: all_gather and all_to_all of uneven pieces, then a Partial sum to Replicate
    (all_reduce) and to Shard (reduce_scatter), except for bool (its sum is int64)."""
    x = integral((5, 7), dtype, 1)
    since = now_us()
    by_cols = monarch.distribute_tensor(x, mesh, {"tp": Shard(1)})
    assert torch.equal(by_cols.redistribute({"tp": Shard(0)}).full_tensor(timeout=T), x)
    t = monarch.distribute_tensor(x, mesh, {"dp": Shard(0), "tp": Shard(1)})
    assert torch.equal(t.redistribute({}).full_tensor(timeout=T), x)
    if dtype != torch.bool:
        s = t.sum(0)  # Partial over dp, Shard(0) over tp
        assert torch.equal(s.redistribute({"tp": Shard(0)}).full_tensor(timeout=T), x.sum(0))
        assert torch.equal(s.redistribute({"dp": Shard(0), "tp": Replicate()}).full_tensor(timeout=T), x.sum(0))
    kinds = ran(mesh, since)
    assert set(kinds) == (KINDS if dtype != torch.bool else {"all_gather", "all_to_all"}), kinds
    assert set.union(*kinds.values()) == {"torch-gloo"}, kinds


def test_empty_pieces(mesh: ProcMesh) -> None:
    """Every kind of redistribution of empty tensors, and a Partial sum of empty rows to Shard and Replicate."""
    for shape, placements in [((0, 3), {"tp": Shard(0)}), ((0, 3), {"dp": Shard(0), "tp": Shard(0)}),
                              ((2, 0), {"tp": Shard(1)})]:
        t = monarch.distribute_tensor(torch.randn(shape), mesh, placements)
        assert t.redistribute({}).full_tensor(timeout=T).shape == shape
        assert t.redistribute({"dp": Shard(1)}).full_tensor(timeout=T).shape == shape
    s = monarch.distribute_tensor(torch.ones(2, 0, 3), mesh, {"dp": Shard(0)}).sum(0)
    assert s.redistribute({"dp": Shard(0)}).full_tensor(timeout=T).shape == (0, 3)
    assert s.redistribute({}).full_tensor(timeout=T).shape == (0, 3)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_redistributions_are_exact(mesh: ProcMesh, data: st.DataObject) -> None:
    """Shard/Replicate to Shard/Replicate and a Partial sum to either, uneven pieces, every dtype of the MPI path's
    tests."""
    shape = data.draw(tensor_shapes(min_dims=2, max_dims=3), label="shape")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    src = data.draw(placement_tuples(len(shape), 2, partial=False), label="src")
    dst = data.draw(placement_tuples(len(shape) - 1, 2, partial=False), label="dst")
    x = integral(shape, dtype, data.draw(st.integers(0, 2**16)))
    since = now_us()
    t = monarch.distribute_tensor(x, mesh, src)
    assert torch.equal(t.redistribute(dst).full_tensor(timeout=T), x)
    if dtype != torch.bool:
        assert torch.equal(t.sum(0).redistribute(dst).full_tensor(timeout=T), x.sum(0))
    assert set().union(*ran(mesh, since).values()) <= {"torch-gloo"}


def test_compiled_training_step_buckets_through_torch(mesh: ProcMesh) -> None:
    """Data parallel over dp, tensor parallel over tp (tests/checkpoint's model, dropout off): equal losses."""
    data = batches(3)
    plain, plain_opt = build(None)
    want = losses(stepper(plain.eval(), plain_opt, False), data)
    model, opt = build(mesh)
    since = now_us()
    got = losses(stepper(model.eval(), opt, True), data)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    kinds = ran(mesh, since)
    assert kinds.get("all_reduce (bucket)") == {"torch-gloo"}, kinds
    assert set.union(*kinds.values()) == {"torch-gloo"}, kinds


def test_checkpoint_resumes_through_torch(mesh: ProcMesh, tmp_path: Path) -> None:
    """A compiled loop saved in the middle resumes with the uninterrupted losses on dp=4 and one process."""
    since = now_us()
    resume(mesh, [mesh.flatten("dp"), mesh.slice(dp=0, tp=0)], tmp_path / "c", compiled=True)
    assert set.union(*ran(mesh, since).values()) == {"torch-gloo"}
