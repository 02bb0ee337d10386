"""Ops along one dim (graph/rules/reduce.py): cumulative scans, sorts, topk, kthvalue, median and mode
against plain torch on the reference mesh for random shapes and placements (uneven shards, empty
pieces); no data moves when only other dims are sharded; the rule itself on hand-built specs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.graph.rules.table import RULES, OpCall
from monarch.shape import Extent
from monarch.tensor.spec import Spec
from tests.graph.rule_cases import check, run
from tests.strategies import placement_tuples, reference_mesh, tensor_meshes, tensor_shapes

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")
MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})
Op = Callable[[torch.Tensor, int, int, bool], Any]  # fn(x, dim, k, keepdim)
pytestmark = pytest.mark.usefixtures("strict")

OPS: dict[str, Op] = {
    "cumsum": lambda x, d, k, keep: torch.cumsum(x, d),
    "cumsum_f64": lambda x, d, k, keep: torch.cumsum(x, d, dtype=torch.float64),
    "cumprod": lambda x, d, k, keep: torch.cumprod(x, d),
    "logcumsumexp": lambda x, d, k, keep: torch.logcumsumexp(x, d),
    "cummax": lambda x, d, k, keep: torch.cummax(x, d),
    "cummin": lambda x, d, k, keep: torch.cummin(x, d),
    "sort": lambda x, d, k, keep: torch.sort(x, d, descending=keep),
    "sort_stable": lambda x, d, k, keep: torch.sort(x, dim=d, stable=True),
    "argsort": lambda x, d, k, keep: torch.argsort(x, d),
    "msort": lambda x, d, k, keep: torch.msort(x),
    "topk": lambda x, d, k, keep: torch.topk(x, k, d, largest=keep),
    "kthvalue": lambda x, d, k, keep: torch.kthvalue(x, k, d, keepdim=keep),
    "median": lambda x, d, k, keep: torch.median(x, d, keepdim=keep),
    "nanmedian": lambda x, d, k, keep: torch.nanmedian(x, d, keepdim=keep),
    "mode": lambda x, d, k, keep: torch.mode(x, d, keepdim=keep),
    "median_all": lambda x, d, k, keep: torch.median(x),
}


def distinct(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct values in [0.5, 1.5): sorts, selections and their indices have one right answer."""
    n = 1
    for s in shape:
        n *= s
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(torch.float32)
    return (0.5 + perm / max(n, 1)).reshape(shape)


@pytest.mark.parametrize("name", sorted(OPS))
@settings(deadline=None, max_examples=20)
@given(data=st.data())
def test_along_dim_matches_torch(name: str, data: st.DataObject) -> None:
    dims = data.draw(tensor_meshes(MESHES))
    shape = data.draw(tensor_shapes(1, 3, 1, 7))
    placements = data.draw(placement_tuples(len(shape), len(dims), partial=True))
    dim = 0 if name == "msort" else data.draw(st.integers(-len(shape), len(shape) - 1))
    k = data.draw(st.integers(1, shape[dim]))
    keep = data.draw(st.booleans())
    base = distinct(shape, data.draw(st.integers(0, 2**16)))
    fn = OPS[name]
    mesh = reference_mesh(dims)
    got, comms = run(mesh, lambda t: fn(t, dim, k, keep), monarch.distribute_tensor(base, mesh, placements))
    check(got, fn(base, dim, k, keep), rtol=1e-5, atol=1e-6)
    whole = name == "median_all"
    partial = any(p.is_partial() for p in placements)
    along = any(p == Shard(dim % len(shape)) for p in placements)
    if not whole and not along and not partial:
        assert comms == [], f"{name} along an unsharded dim moved data: {comms}"


@pytest.mark.parametrize("name", sorted(set(OPS) - {"median_all"}))
def test_empty_and_uneven_pieces_stay_sharded(name: str) -> None:
    """Rows over 4 ranks: pieces of 1, 1, 0 and 0 rows (and 2, 2, 1, 0 for 5); the op runs along dim 1
    (msort along 0, over columns sharded 2, 2, 1, 0) without moving data."""
    mesh = reference_mesh({"x": 4})
    fn = OPS[name]
    for rows in (2, 5):
        base = distinct((rows, 5) if name != "msort" else (5, rows), rows)
        shard = Shard(1) if name == "msort" else Shard(0)
        dim = 0 if name == "msort" else 1
        x = monarch.distribute_tensor(base, mesh, {"x": shard})
        out = fn(x, dim, 2, False)
        assert all(t.placements == (shard,) for t in (out if isinstance(out, tuple) else (out,))), name
        got, comms = run(mesh, lambda t: t, out)
        check(got, fn(base, dim, 2, False), rtol=1e-5, atol=1e-6)
        assert comms == [], comms


def test_nested_shards_and_dropped_dim_renumber() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    base = distinct((4, 5, 3), 7)
    x = monarch.distribute_tensor(base, mesh, {"dp": Shard(0), "tp": Shard(2)})
    values, indices = torch.kthvalue(x, 2, 1)
    assert values.placements == indices.placements == (Shard(0), Shard(1))
    assert torch.cumsum(x, 1).placements == (Shard(0), Shard(2))
    got, comms = run(mesh, lambda t: torch.kthvalue(t, 2, 1), x)
    check(got, torch.kthvalue(base, 2, 1), rtol=1e-5, atol=1e-6)
    assert comms == []


def test_cumsum_of_partial_stays_partial_and_sort_along_shard_gathers() -> None:
    mesh = reference_mesh({"x": 2})
    base = distinct((3, 4), 3)
    x = monarch.distribute_tensor(base, mesh, {"x": P})
    assert torch.cumsum(x, 1).placements == (P,)
    check(run(mesh, lambda t: torch.cumsum(t, 1), x)[0], torch.cumsum(base, 1), rtol=1e-5, atol=1e-6)
    y = monarch.distribute_tensor(base, mesh, {"x": Shard(1)})
    got, comms = run(mesh, lambda t: torch.sort(t, 1), y)
    check(got, torch.sort(base, 1), rtol=1e-5, atol=1e-6)
    assert torch.sort(y, 1)[0].placements == (Shard(0),)


def test_rule_offers_every_other_dim() -> None:
    mesh = Extent(("x",), (2,))
    spec = Spec((4, 5, 6), (30, 6, 1), torch.float32, (R,), mesh)
    out = Spec((4, 6), (6, 1), torch.float32, (R,), mesh)
    call = OpCall(aten.median.dim, (spec, 1), {}, (spec,), (out, out))
    strategies = RULES[aten.median.dim](call, 0)
    assert [(s.inputs, s.outputs) for s in strategies] == [((Shard(0),), (Shard(0),) * 2),
                                                           ((Shard(2),), (Shard(1),) * 2)]
    sort = OpCall(aten.sort.default, (spec,), {}, (spec,), (spec, spec))
    assert [s.inputs for s in RULES[aten.sort.default](sort, 0)] == [(Shard(0),), (Shard(1),)]  # dim=-1 default


@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_searchsorted(data: st.DataObject) -> None:
    """A 1-D sequence with values sharded anywhere, or an N-D one sharded with the values on leading dims;
    with and without a sorter. Nothing moves when the sequence's searched dim is whole."""
    dims = data.draw(tensor_meshes(MESHES))
    mesh = reference_mesh(dims)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    lead = data.draw(tensor_shapes(0, 2, 1, 5))
    seq = torch.rand(*lead, data.draw(st.integers(1, 6)), generator=gen)
    values = torch.rand(*lead, data.draw(st.integers(1, 6)), generator=gen)
    sorter = torch.argsort(seq, -1) if data.draw(st.booleans()) else None
    if sorter is None:
        seq = seq.sort(-1).values
    right = data.draw(st.booleans())
    put = [data.draw(placement_tuples(t.ndim, len(dims), partial=False)) for t in (seq, values)]
    args = [monarch.distribute_tensor(t, mesh, p) for t, p in zip((seq, values), put, strict=True)]
    ms = monarch.distribute_tensor(sorter, mesh, put[0]) if sorter is not None else None
    got, comms = run(mesh, lambda t: torch.searchsorted(*t, right=right, sorter=ms), args)
    check(got, torch.searchsorted(seq, values, right=right, sorter=sorter), rtol=1e-5, atol=1e-6)
    if seq.ndim == 1 and all(p == R for p in put[0]):
        assert comms == [], comms
