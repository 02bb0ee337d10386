"""Sharding rules of joining, indexing and factory ops (rules_index.py, rules_factory.py) on LocalMesh.

cat, stack, index_select, gather and index.Tensor on randomly placed (uneven, nested, Partial) inputs
and indices equal plain torch exactly under MONARCH_STRICT=1; *_like and new_* keep their argument's
shard without moving it; random *_like draws agree on every rank. Key cases pin the collectives.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import placement_tuples, tensor_shapes
from test_rules_view import LINE, MESHES, SETTINGS, check, data, mesh_of, pairs, sharded, shipped, spec

import monarch
from monarch import config
from monarch.graph.rules.table import RULES, OpCall
from monarch.runtime.session.local import LocalMesh
from monarch.tensor import MeshTensor, Partial, Replicate, Shard

pytestmark = pytest.mark.usefixtures("strict")

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")


def indices(shape: tuple[int, ...], high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def index_case(draw: st.DrawFn, shape: tuple[int, ...], mesh_ndim: int, high: int,
               max_dims: int = 2) -> tuple[torch.Tensor, tuple]:
    """An int64 index tensor with values in [0, high) and random placements (never Partial)."""
    ishape = draw(tensor_shapes(1, max_dims)) if not shape else shape
    return indices(ishape, high, draw(st.integers(0, 99))), draw(placement_tuples(len(ishape), mesh_ndim, False))


# -- cat / stack -----------------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_cat_and_stack(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(-len(shape), len(shape) - 1))
    sizes = data_.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    parts = [data(tuple(n if k == d % len(shape) else s for k, s in enumerate(shape))) * (i + 1)
             for i, n in enumerate(sizes)]
    inputs = [(t, data_.draw(placement_tuples(len(shape), len(dims)))) for t in parts]
    check(lambda *xs: torch.cat(xs, d), dims, (data(shape), ps), *inputs)
    same = [(data(shape) * (i + 2), data_.draw(placement_tuples(len(shape), len(dims)))) for i in range(len(sizes))]
    at = data_.draw(st.integers(0, len(shape)))
    check(lambda *xs: torch.stack(xs, at), dims, (data(shape), ps), *same)


# -- index_select / gather / index ----------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_index_select(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(0, len(shape) - 1))
    index = data_.draw(index_case((data_.draw(st.integers(1, 7)),), len(dims), shape[d]))
    check(lambda x, i: x.index_select(d, i), dims, (data(shape), ps), index)


@given(case=sharded(), data_=st.data())
@SETTINGS
def test_gather(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(0, len(shape) - 1))
    ishape = tuple(data_.draw(st.integers(1, 7)) if k == d else data_.draw(st.sampled_from([n, max(1, n - 1)]))
                   for k, n in enumerate(shape))
    index = data_.draw(index_case(ishape, len(dims), shape[d]))
    check(lambda x, i: x.gather(d, i), dims, (data(shape), ps), index)


@given(case=sharded(min_dims=2, max_dims=3), data_=st.data())
@SETTINGS
def test_index_tensor(case, data_) -> None:
    dims, shape, ps = case
    n = len(shape)
    i0 = data_.draw(index_case((), len(dims), shape[0]))
    i1 = (indices(i0[0].shape, shape[1], 7), data_.draw(placement_tuples(i0[0].ndim, len(dims), False)))
    il = (indices(i0[0].shape, shape[-1], 8), i1[1])
    check(lambda x, a, b, c: (x[a], x[:, b], x[a, b], x[..., c], x[a, ..., c] if n == 3 else x[a, c]),
          dims, (data(shape), ps), i0, i1, il)


# -- factories ------------------------------------------------------------------------------------
@given(case=sharded(), size=tensor_shapes(0, 3), value=st.integers(-3, 3))
@SETTINGS
def test_like_and_new(case, size, value) -> None:
    dims, shape, ps = case
    like = check(lambda x: (torch.zeros_like(x), torch.ones_like(x, dtype=torch.int32), torch.full_like(x, value),
                            torch.empty_like(x).zero_()), dims, (data(shape), ps))
    kept = tuple(p if isinstance(p, Shard) else R for p in ps)
    assert all(y.placements == kept for y in like)
    check(lambda x: (x.new_zeros(size), x.new_ones(size), x.new_full(size, value), x.new_empty(size).fill_(1),
                     x.new_zeros(shape)), dims, (data(shape), ps))


@given(case=sharded(), kind=st.sampled_from(["rand", "randn", "randint", "randint_low"]))
@SETTINGS
def test_random_like_is_one_global_draw(case, kind) -> None:
    """Each rank holds its own piece of one tensor: replicated copies agree, values are in range."""
    dims, shape, ps = case
    mesh = mesh_of(dims)
    make = {"rand": torch.rand_like, "randn": torch.randn_like, "randint": lambda x: torch.randint_like(x, 5),
            "randint_low": lambda x: torch.randint_like(x, 2, 5)}[kind]
    (y,) = check(lambda x: make(x).mul(0), dims, (data(shape), ps))
    z = make(mesh_tensor(mesh, shape, ps))
    full = z.full_tensor()
    assert full.shape == shape and full.dtype == torch.float32
    if kind.startswith("randint"):
        assert full.min() >= (2 if kind == "randint_low" else 0) and full.max() < 5 and torch.equal(full, full.round())
    elif kind == "rand":
        assert 0 <= full.min() and full.max() < 1
    for eng, coords in zip(mesh.session.runner.engines, mesh.session.abstract.coords(), strict=True):
        start_len = z.spec.bounds(coords)
        piece = full
        for k, (s, n) in enumerate(start_len):
            piece = piece.narrow(k, s, n)
        assert torch.equal(eng.store[z._handle.id], piece)


def mesh_tensor(mesh: LocalMesh, shape: tuple[int, ...], ps: tuple) -> MeshTensor:
    return monarch.distribute_tensor(data(shape), mesh, list(ps))


# -- collectives -----------------------------------------------------------------------------------
S0, S1 = Shard(0), Shard(1)


@pytest.mark.parametrize("fn, inputs, want, comms", [
    (lambda a, b: torch.cat([a, b], 0), [((3, 5), (S1,)), ((2, 5), (S1,))], (S1,), []),
    (lambda a, b: torch.cat([a, b], 1), [((3, 5), (S0,)), ((3, 2), (P,))], (S0,), ["reduce_scatter[x]"]),
    (lambda a, b: torch.stack([a, b], 0), [((3, 5), (S1,)), ((3, 5), (S1,))], (Shard(2),), []),
    (lambda a, b: torch.cat([a, b]), [((3, 5), (P,)), ((2, 5), (P,))], (P,), []),
])
def test_join_collectives(fn, inputs, want, comms) -> None:
    y, got = shipped({"x": 2}, fn, *[(data(s), ps) for s, ps in inputs])
    assert (y.placements, got) == (want, comms)
    assert torch.equal(y.full_tensor(), fn(*(data(s) for s, _ in inputs)))


I5 = indices((5,), 4, 0)


@pytest.mark.parametrize("fn, x_ps, i_ps, want", [
    (lambda x, i: x.index_select(0, i), (S1,), (R,), (S1,)),
    (lambda x, i: x.index_select(0, i), (R,), (S0,), (S0,)),
    (lambda x, i: x.index_select(1, i), (R,), (S0,), (S1,)),
    (lambda x, i: x.index_select(0, i), (P,), (R,), (P,)),
    (lambda x, i: x[:, i], (S0,), (R,), (S0,)),
    (lambda x, i: x[i], (R,), (S0,), (S0,)),
    (lambda x, i: x[:, i], (R,), (S0,), (S1,)),
    (lambda x, i: x[i], (P,), (R,), (P,)),
])
def test_index_collectives(fn, x_ps, i_ps, want) -> None:
    y, got = shipped({"x": 2}, fn, (data((4, 4)), x_ps), (I5, i_ps))
    assert (y.placements, got) == (want, [])
    assert torch.equal(y.full_tensor(), fn(data((4, 4)), I5))


@pytest.mark.parametrize("x_ps, i_ps, want", [((S0,), (S0,), (S0,)), ((R,), (S1,), (S1,)), ((P,), (R,), (P,))])
def test_gather_collectives(x_ps, i_ps, want) -> None:
    index = indices((5, 3), 4, 1)
    y, got = shipped({"x": 2}, lambda x, i: x.gather(1, i), (data((5, 4)), x_ps), (index, i_ps))
    assert (y.placements, got) == (want, [])
    assert torch.equal(y.full_tensor(), data((5, 4)).gather(1, index))


@pytest.mark.parametrize("dims", MESHES[1:])
def test_factories_move_nothing(dims) -> None:
    ps = (S0,) + (Shard(1),) * (len(dims) - 1)
    outs, got = shipped(dims, lambda x: (torch.zeros_like(x), torch.rand_like(x), x.new_zeros(6, 2),
                                         x.new_full((6, 5), 2.0)), (data((6, 5)), ps))
    assert got == []
    assert [y.placements for y in outs] == [ps, ps, (S0,) + (R,) * (len(dims) - 1), ps]


# -- rules on hand-built calls ---------------------------------------------------------------------
def test_cat_rule_shards_every_dim_but_the_cat_dim() -> None:
    a, b = spec((3, 5), (R,), LINE), spec((2, 5), (P,), LINE)
    call = OpCall(aten.cat.default, ([a, b], 0), {}, (a, b), (spec((5, 5), (R,), LINE),))
    assert pairs(RULES[aten.cat.default](call, 0)) == {((S1, S1), (S1,)), ((P, P), (P,))}


def test_gather_rule_needs_equal_sizes_off_dim() -> None:
    x, i = spec((5, 4), (R,), LINE), spec((3, 2), (R,), LINE, torch.int64)
    call = OpCall(aten.gather.default, (x, 1, i), {}, (x, i), (spec((3, 2), (R,), LINE),))
    assert pairs(RULES[aten.gather.default](call, 0)) == {((R, S1), (S1,))}


def test_new_rule_keeps_the_argument_in_place() -> None:
    x = spec((6, 5), (P,), LINE)
    call = OpCall(aten.new_zeros.default, (x, [6, 2]), {}, (x,), (spec((6, 2), (R,), LINE),))
    assert pairs(RULES[aten.new_zeros.default](call, 0)) == {((P,), (R,))}
    x = x.with_placements((S0,))
    call = OpCall(aten.new_zeros.default, (x, [6, 2]), {}, (x,), call.outs)
    assert pairs(RULES[aten.new_zeros.default](call, 0)) == {((S0,), (R,)), ((S0,), (S0,))}


def test_strict_mode_is_on() -> None:
    """The shared autouse fixture applies here too, so no test above ran an op without a rule."""
    assert config.strict()
