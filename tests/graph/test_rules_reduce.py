"""Reduction rules (graph/rules/reduce.py) on the reference mesh: values against plain torch for random
shapes (uneven and empty shards included) and placements, collectives for the key cases, and the rules
themselves on hand-built specs.
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
from monarch.graph.propagate import decide
from monarch.graph.rules.table import RULES, Emit, OpCall, Strategy
from monarch.program.instr import Buf
from monarch.shape import Extent
from monarch.tensor.spec import Spec
from tests.graph.rule_cases import check, run
from tests.strategies import placement_tuples, reference_mesh, tensor_meshes, tensor_shapes

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")
MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})
Op = Callable[[torch.Tensor, list[int], bool], Any]

# name -> (fn(x, dims, keepdim), kind of data, whether it combines per-piece results, what it reduces:
# "dims" a list of dims, "dim" one dim (dims[0]), "all" every dim)
OPS: dict[str, tuple[Op, str, bool, str]] = {
    "sum": (lambda x, dims, k: x.sum(dims, keepdim=k), "float", True, "dims"),
    "sum_all": (lambda x, dims, k: x.sum(), "float", True, "all"),
    "sum_int": (lambda x, dims, k: x.sum(dims, keepdim=k), "int", True, "dims"),
    "sum_bool": (lambda x, dims, k: x.sum(dims), "bool", True, "dims"),
    "mean": (lambda x, dims, k: x.mean(dims, keepdim=k), "float", True, "dims"),
    "mean_all": (lambda x, dims, k: x.mean(), "float", True, "all"),
    "mean_f64": (lambda x, dims, k: x.mean(dims, dtype=torch.float64), "float", True, "dims"),
    "amax": (lambda x, dims, k: x.amax(dims, k), "float", True, "dims"),
    "amin": (lambda x, dims, k: x.amin(dims, k), "float", True, "dims"),
    "amax_int": (lambda x, dims, k: x.amax(dims, k), "int", True, "dims"),
    "amin_bool": (lambda x, dims, k: x.amin(dims, k), "bool", True, "dims"),
    "max_all": (lambda x, dims, k: x.max(), "float", True, "all"),
    "min_all": (lambda x, dims, k: x.min(), "int", True, "all"),
    "prod": (lambda x, dims, k: x.prod(dims[0], keepdim=k), "float", True, "dim"),
    "prod_all": (lambda x, dims, k: x.prod(), "float", True, "all"),
    "any": (lambda x, dims, k: x.any(dims[0], keepdim=k), "bool", True, "dim"),
    "any_all": (lambda x, dims, k: x.any(), "bool", True, "all"),
    "all": (lambda x, dims, k: x.all(dim=tuple(dims), keepdim=k), "bool", True, "dims"),
    "max_dim": (lambda x, dims, k: x.max(dims[0], keepdim=k), "float", False, "dim"),
    "min_dim": (lambda x, dims, k: x.min(dims[0], keepdim=k), "float", False, "dim"),
    "argmax": (lambda x, dims, k: x.argmax(dims[0], keepdim=k), "float", False, "dim"),
    "argmin_all": (lambda x, dims, k: x.argmin(), "float", False, "all"),
    "var": (lambda x, dims, k: x.var(dims, keepdim=k), "float", False, "dims"),
    "std_all": (lambda x, dims, k: x.std(), "float", False, "all"),
    "var_mean": (lambda x, dims, k: torch.var_mean(x, dims, correction=0, keepdim=k), "float", False, "dims"),
    "std_mean": (lambda x, dims, k: torch.std_mean(x, dims[0]), "float", False, "dim"),
}
pytestmark = pytest.mark.usefixtures("strict")


def values(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "int":
        return torch.randint(-20, 20, shape, generator=gen)
    x = torch.rand(shape, generator=gen)
    return x > 0.5 if kind == "bool" else x + 0.5  # in [0.5, 1.5): products stay finite


@st.composite
def cases(draw: st.DrawFn, name: str) -> tuple[dict[str, int], tuple[int, ...], tuple, list[int], bool, int]:
    dims = draw(tensor_meshes(MESHES))
    shape = draw(tensor_shapes(1, 3, 1, 7))
    placements = draw(placement_tuples(len(shape), len(dims), partial=OPS[name][1] == "float"))
    ndim = len(shape)
    how = OPS[name][3]
    reduced = draw(st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=1 if how == "dim" else ndim,
                            unique_by=lambda d: d % ndim))
    if how == "all":
        reduced = list(range(ndim))
    return dims, shape, placements, reduced, draw(st.booleans()), draw(st.integers(0, 2**16))


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("name", sorted(OPS))
@settings(deadline=None, max_examples=25)
@given(data=st.data())
def test_reduction_matches_torch(name: str, data: st.DataObject) -> None:
    dims, shape, placements, reduced, keep, seed = data.draw(cases(name))
    fn, kind, combines, _ = OPS[name]
    mesh = reference_mesh(dims)
    base = values(shape, kind, seed)
    x = monarch.distribute_tensor(base, mesh, placements)
    got, comms = run(mesh, lambda t: fn(t, reduced, keep), x)
    check(got, fn(base, reduced, keep))
    names = list(dims)
    axes = {d % len(shape) for d in reduced}
    sharded_reduced = sorted(names[m] for m, p in enumerate(placements)  # (one rank: nothing to reduce over)
                             if isinstance(p, Shard) and p.dim in axes and dims[names[m]] > 1)
    if not any(p.is_partial() for p in placements):
        if not sharded_reduced:
            assert comms == [], f"{name} over unsharded dims moved data: {comms}"
        elif combines:
            assert sorted(comms) == [f"all_reduce[{n}]" for n in sharded_reduced], comms


def test_sum_over_sharded_dim_is_one_all_reduce() -> None:
    mesh = reference_mesh({"x": 4})
    base = torch.randn(5, 3)
    y = monarch.distribute_tensor(base, mesh, {"x": Shard(0)}).sum(0)
    assert y.placements == (P,)
    got, comms = run(mesh, lambda t: t, y)
    check(got, base.sum(0))
    assert comms == ["all_reduce[x]"]


def test_mean_over_uneven_shards_is_exact() -> None:
    mesh = reference_mesh({"x": 4})
    base = torch.randn(5, 3, dtype=torch.float64)  # pieces of 2, 2, 1 and 0 rows
    y = monarch.distribute_tensor(base, mesh, {"x": Shard(0)}).mean(0)
    assert y.placements == (P,)
    torch.testing.assert_close(y.full_tensor(), base.mean(0), rtol=1e-12, atol=1e-12)


def test_reduction_keeps_other_shards_and_shifts_dims() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    base = torch.randn(4, 5, 6)
    x = monarch.distribute_tensor(base, mesh, {"dp": Shard(0), "tp": Shard(2)})
    y = x.sum(1)
    assert y.placements == (Shard(0), Shard(1))
    z = x.amax(1, keepdim=True)
    assert z.placements == (Shard(0), Shard(2))
    got, comms = run(mesh, lambda t: (t[0], t[1]), (y, z))
    check(got, (base.sum(1), base.amax(1, keepdim=True)))
    assert comms == []


def test_partial_input_passes_through() -> None:
    mesh = reference_mesh({"x": 2})
    base = torch.randn(3, 4)
    x = monarch.distribute_tensor(base, mesh, {"x": P})
    for fn in (lambda t: t.sum(1), lambda t: t.mean(), lambda t: t.sum(0, keepdim=True)):
        y = fn(x)
        assert y.placements == (P,)
        got, comms = run(mesh, lambda t: t, y)
        check(got, fn(base))
        assert comms == ["all_reduce[x]"]


def test_extremes_and_predicates_give_partial_max_min() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    base = torch.randn(3, 5)  # dim 1 over tp: pieces of 3 and 2; dim 0 over dp: 2 and 1
    x = monarch.distribute_tensor(base, mesh, {"dp": Shard(0), "tp": Shard(1)})
    assert x.amax(1).placements == (Shard(0), Partial("max"))
    assert x.min().placements == (Partial("min"), Partial("min"))
    assert (x > 0).any(1).placements == (Shard(0), Partial("max"))
    assert (x > 0).all().placements == (Partial("min"), Partial("min"))
    assert x.prod(0).placements == (Partial("prod"), Shard(0))
    got, comms = run(mesh, lambda t: t.amax(0), x)
    check(got, base.amax(0))
    assert comms == ["all_reduce[dp]"]


def test_extremes_pad_empty_pieces() -> None:
    mesh = reference_mesh({"x": 4})
    base = torch.randint(-9, 9, (2, 3))  # dim 0 over 4 ranks: pieces of 1, 1, 0 and 0 rows
    x = monarch.distribute_tensor(base, mesh, {"x": Shard(0)})
    check(run(mesh, lambda t: t.amax(0), x)[0], base.amax(0))
    check(run(mesh, lambda t: t.min(), x)[0], base.min())


def test_indices_and_moments_gather_reduced_dims() -> None:
    mesh = reference_mesh({"x": 2})
    base = torch.randn(4, 6)
    x = monarch.distribute_tensor(base, mesh, {"x": Shard(1)})
    values, indices = x.max(1)
    assert values.placements == indices.placements == (Shard(0),)  # moved to a dim that is kept
    check(run(mesh, lambda t: (t.max(1)[0], t.max(1)[1]), x)[0], base.max(1))
    check(run(mesh, lambda t: t.var(0), x)[0], base.var(0))
    assert x.var(0).placements == (Shard(0),)


# -- the rules on hand-built specs ------------------------------------------------------------------
MESH = Extent(("x",), (2,))


def spec(shape: tuple[int, ...], *placements: Any, dtype: torch.dtype = torch.float32) -> Spec:
    stride = tuple(torch.empty(shape, device="meta").stride())
    return Spec(shape, stride, dtype, tuple(placements) or (R,), MESH)


def test_rule_lists_kept_and_partial_strategies() -> None:
    x, out = spec((4, 6, 5), Shard(1)), spec((6,))
    call = OpCall(aten.sum.dim_IntList, (x, [0, -1]), {}, (x,), (out,))
    strategies = RULES[aten.sum.dim_IntList](call, 0)
    assert set(strategies) == {Strategy((Shard(1),), (Shard(0),)), Strategy((Shard(0),), (P,)),
                               Strategy((Shard(2),), (P,))}
    keep = OpCall(aten.amax.default, (x, [0], True), {}, (x,), (spec((1, 6, 5)),))
    assert Strategy((Shard(2),), (Shard(2),)) in RULES[aten.amax.default](keep, 0)
    assert decide(call).outs[0].placements == (Shard(0),)


def test_rule_mean_emits_sum_over_global_count() -> None:
    x, out = spec((5, 3), Shard(0)), spec((3,))
    call = OpCall(aten.mean.dim, (x, [0]), {}, (x,), (out,))
    d = decide(call)
    assert d.outs[0].placements == (P,) and d.emit is not None
    temps = iter(range(-1, -100, -1))
    ctx = Emit(call, d.ins, d.outs, (1,), (Buf(1), [0]), {}, (2,), lambda: next(temps))
    ops = [(i.op, i.args[1:]) for i in d.emit(ctx)]
    assert ops == [("aten::sum.dim_IntList", ([0], False)), ("aten::div.Scalar", (5,))]


def test_rule_var_never_splits_a_reduced_dim() -> None:
    x = spec((4, 6), Shard(1))
    call = OpCall(aten.var.correction, (x, [1]), {"correction": 1}, (x,), (spec((4,)),))
    assert RULES[aten.var.correction](call, 0) == [Strategy((Shard(0),), (Shard(0),))]
    assert decide(call).ins[0].placements == (Shard(0),)
