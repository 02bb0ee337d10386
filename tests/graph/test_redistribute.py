"""Redistribution plans as data, and their execution on the in-process reference mesh.

Single-dim transitions map to exactly one documented step kind; nested shards over two mesh dims are
undone innermost first and re-chunked outermost first. On LocalMesh, any src -> dst redistribution of
any (uneven) shape keeps the values exactly and ships exactly the plan's collectives.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, reference_mesh, tensor_meshes, tensor_shapes

import monarch
from monarch.graph.redistribute import cost, direct_kind, plan
from monarch.shape import Extent
from monarch.tensor import Partial, Replicate, Shard, Spec

R, P = Replicate(), Partial("sum")
S0, S1 = Shard(0), Shard(1)
LINE = Extent(("x",), (4,))
GRID = Extent(("dp", "tp"), (2, 2))

SINGLE = [
    (R, R, []), (R, S0, ["chunk"]), (R, S1, ["chunk"]), (R, P, ["partialize"]),
    (S0, R, ["all_gather"]), (S0, S0, []), (S0, S1, ["all_to_all"]), (S0, P, ["all_gather", "partialize"]),
    (S1, R, ["all_gather"]), (S1, S0, ["all_to_all"]), (S1, S1, []), (S1, P, ["all_gather", "partialize"]),
    (P, R, ["all_reduce"]), (P, S0, ["reduce_scatter"]), (P, S1, ["reduce_scatter"]), (P, P, []),
]

NESTED = [  # (src, dst, steps as "kind[mesh dim]")
    ((S0, S0), (R, S0), ["all_gather[tp]", "all_gather[dp]", "chunk[tp]"]),
    ((S0, S0), (S0, R), ["all_gather[tp]"]),
    ((S0, S0), (R, R), ["all_gather[tp]", "all_gather[dp]"]),
    ((R, R), (S0, S0), ["chunk[dp]", "chunk[tp]"]),
    ((S0, S1), (S0, R), ["all_gather[tp]"]),
    ((S0, S1), (S1, S1), ["all_gather[tp]", "all_gather[dp]", "chunk[dp]", "chunk[tp]"]),
    ((S0, R), (S1, R), ["all_to_all[dp]"]),
    ((P, S0), (R, S0), ["all_reduce[dp]"]),
    ((P, S1), (S0, S1), ["reduce_scatter[dp]"]),
    ((S0, P), (S0, R), ["all_reduce[tp]"]),
    ((S0, P), (S0, S1), ["reduce_scatter[tp]"]),
    ((P, P), (R, R), ["all_reduce[tp]", "all_reduce[dp]"]),
    ((R, R), (P, P), ["partialize[dp]", "partialize[tp]"]),
]


def spec(shape: tuple[int, ...], placements: tuple, mesh: Extent, dtype: torch.dtype = torch.float32) -> Spec:
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return Spec(shape, tuple(meta.stride()), dtype, placements, mesh)


def named(p) -> list[str]:
    return [f"{s.kind}[{s.before.mesh.labels[s.mdim]}]" for s in p.steps]


@pytest.mark.parametrize("src, dst, kinds", SINGLE, ids=[f"{a}->{b}" for a, b, _ in SINGLE])
def test_single_dim_steps(src, dst, kinds) -> None:
    p = plan(spec((5, 7), (src,), LINE), (dst,))
    assert [s.kind for s in p.steps] == kinds
    assert p.dst.placements == (dst,)
    assert p.comms() == [k for k in kinds if k not in ("chunk", "partialize")]
    assert (p.cost() == 0) == (not p.comms())
    assert p.cost() == (cost(direct_kind(src, dst), p.src, 0) if src != dst else 0)  # what propagation weighs


@pytest.mark.parametrize("src, dst, steps", NESTED, ids=[f"{a}->{b}" for a, b, _ in NESTED])
def test_nested_steps(src, dst, steps) -> None:
    p = plan(spec((6, 5), src, GRID), dst)
    assert named(p) == steps
    assert p.dst.placements == dst
    for before, after in zip(p.steps, p.steps[1:], strict=False):
        assert before.after == after.before


def test_step_specs_chain_and_cost() -> None:
    p = plan(spec((8, 8), (S0, S1), GRID), (R, R))
    assert p.src.placements == (S0, S1) and p.steps[-1].after.placements == (R, R)
    assert [s.cost() for s in p.steps] == [64.0, 128.0]  # bytes sent: half of a 128 B piece, half of 256 B
    assert plan(spec((8, 8), (P, R), GRID), (R, R)).cost() == 256.0  # all_reduce sends twice as much
    assert plan(spec((8, 8), (S0, S1), Extent(("dp", "tp"), (1, 1))), (R, R)).cost() == 0
    assert repr(plan(spec((2,), (R,), LINE), (R,))) == "(no-op)"


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, int], tuple[int, ...], tuple, tuple, torch.dtype]:
    dims = draw(tensor_meshes())
    shape = draw(tensor_shapes(min_dims=0, max_dims=3, min_size=0, max_size=7))
    dtype = draw(st.sampled_from([torch.float32, torch.int64]))
    src = draw(placement_tuples(len(shape), len(dims)))
    dst = draw(placement_tuples(len(shape), len(dims)))
    return dims, shape, src, dst, dtype


@settings(max_examples=150, deadline=None)
@given(cases())
def test_redistribute_roundtrip_on_reference(case) -> None:
    dims, shape, src, dst, dtype = case
    mesh = reference_mesh(dims)
    session = mesh.session
    t = (torch.randn(shape) * 100).to(dtype)
    x = monarch.distribute_tensor(t, mesh, src)
    monarch.synchronize(mesh, timeout=10)
    before = len(session.collectives)
    expected = plan(x.spec, dst)
    y = x.redistribute(dst)
    monarch.synchronize(mesh, timeout=10)
    assert y.placements == dst
    assert session.collectives[before:] == [n for n, s in zip(named(expected), expected.steps, strict=True)
                                            if s.is_comm]
    assert [k.split("[")[0] for k in session.collectives[before:]] == expected.comms()
    for coords, engine in zip(mesh_coords(dims), session.runner.engines, strict=True):
        assert tuple(engine.store[y._handle.id].shape) == y.spec.local_shape(coords)
    assert torch.equal(y.full_tensor(timeout=10), t)


def mesh_coords(dims: dict[str, int]) -> list[tuple[int, ...]]:
    return list(Extent(tuple(dims), tuple(dims.values())).coords())


def test_redistribute_of_real_partial_sums() -> None:
    """Partial values that differ on every rank (a matmul over a sharded contraction) reduce exactly."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    a, b = torch.arange(15.).reshape(3, 5), torch.arange(10.).reshape(5, 2) - 4
    y = monarch.distribute_tensor(a, mesh, {"tp": S1}) @ monarch.distribute_tensor(b, mesh, {"tp": S0})
    assert y.placements == (R, P)
    for dst in [(R, R), (R, S0), (S1, S1), (P, S0), (S0, R)]:
        assert torch.equal(y.redistribute(dst).full_tensor(timeout=10), a @ b), dst


def test_redistribute_accepts_dict_and_rejects_unknown_dims() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    x = monarch.distribute_tensor(torch.arange(12.).reshape(3, 4), mesh, {"tp": S1})
    assert x.redistribute({"dp": S0}).placements == (S0, R)
    with pytest.raises(monarch.ShardingError, match="pp"):
        x.redistribute({"pp": S0})
    with pytest.raises(monarch.ShardingError, match="out of range"):
        x.redistribute({"dp": Shard(2)})


def test_explain_prints_specs_outline_and_rank_programs(capsys: pytest.CaptureFixture[str]) -> None:
    """A column- then row-parallel matmul: the graph shows each op's input and output placements,
    the outline counts the redistribution on the longest chain, and every rank's program has the
    single all_reduce."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    x = monarch.distribute_tensor(torch.randn(4, 6), mesh, {"dp": Shard(0)})
    w1 = monarch.distribute_tensor(torch.randn(6, 8), mesh, {"tp": Shard(1)})
    w2 = monarch.distribute_tensor(torch.randn(8, 6), mesh, {"tp": Shard(0)})
    text = monarch.explain(lambda a, b, c: ((a @ b) @ c).redistribute({"dp": Shard(0)}), x, w1, w2)
    assert text in capsys.readouterr().out
    assert "mm(%" in text and "-> float32[4, 6][S(0), P(sum)]" in text
    assert "3 ops; longest chain 3 ops with 1 redistributions" in text
    programs = text.split("rank (")[1:]
    assert len(programs) == 4 and all(p.count("all_reduce") == 1 and "mdim=1" in p for p in programs)
