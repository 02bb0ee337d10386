"""Sharding rules of view and shape ops (monarch/graph/rules/view.py) on the in-process reference mesh.

Every op on randomly placed (uneven, nested, Partial) inputs equals plain torch exactly, with
MONARCH_STRICT=1 so that a missing rule fails instead of running replicated; key cases also pin the
collectives (a transpose or an evenly merging view moves nothing). A few rules and emitters are
checked directly on hand-built OpCall/Spec objects.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, reference_mesh, tensor_meshes, tensor_shapes

import monarch
from monarch.graph.rules.table import RULES, Emit, OpCall, Strategy
from monarch.graph.rules.view import aligned
from monarch.program.instr import Buf
from monarch.shape import Extent
from monarch.tensor import MeshTensor, Partial, Replicate, Shard, Spec

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")
MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
pytestmark = pytest.mark.usefixtures("strict")
mesh_of = reference_mesh


# -- helpers (test_rules_index.py uses them too) ------------------------------------------------------


def data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values, so that any misplaced element shows."""
    return torch.arange(1, math.prod(shape) + 1, dtype=dtype).reshape(shape)


def flat(out: Any) -> list[Any]:
    return [t for o in out for t in flat(o)] if isinstance(out, (tuple, list)) else [out]


def check(fn: Callable[..., Any], dims: dict[str, int], *inputs: tuple[torch.Tensor, tuple]) -> list[MeshTensor]:
    """fn on distributed inputs equals fn on the plain ones, exactly; returns the MeshTensor outputs."""
    mesh = mesh_of(dims)
    xs = [monarch.distribute_tensor(t, mesh, list(ps)) for t, ps in inputs]
    got, want = flat(fn(*xs)), flat(fn(*(t for t, _ in inputs)))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        full = g.full_tensor()
        assert full.shape == w.shape and full.dtype == w.dtype, (full.shape, w.shape)
        assert torch.equal(full, w), (g.placements, full, w)
    return got


def shipped(dims: dict[str, int], fn: Callable[..., Any], *inputs: tuple[torch.Tensor, tuple]) -> tuple[Any, list[str]]:
    """fn's outputs and the collectives its graph ships (fetching excluded)."""
    mesh = mesh_of(dims)
    xs = [monarch.distribute_tensor(t, mesh, list(ps)) for t, ps in inputs]
    s = mesh.session
    s.flush()
    before = len(s.collectives)
    out = fn(*xs)
    s.flush()
    return out, s.collectives[before:]


@st.composite
def sharded(draw: st.DrawFn, min_dims: int = 1, max_dims: int = 4, partial: bool = True,
            ) -> tuple[dict[str, int], tuple[int, ...], tuple]:
    """(mesh dims, global shape with sizes 1-7, placements incl. nested and uneven shards)."""
    dims = draw(tensor_meshes(MESHES))
    shape = draw(tensor_shapes(min_dims, max_dims))
    return dims, shape, draw(placement_tuples(len(shape), len(dims), partial))


def spec(shape: tuple[int, ...], placements: tuple, mesh: Extent, dtype: torch.dtype = torch.float32) -> Spec:
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return Spec(shape, tuple(meta.stride()), dtype, placements, mesh)


def op_call(op: Any, args: tuple, ins: tuple[Spec, ...], mesh: Extent) -> OpCall:
    """The OpCall the tracer would build (output metas from running `op` on meta tensors)."""
    metas = iter([s.meta() for s in ins])
    real = tuple([next(metas) for _ in a] if isinstance(a, list) and a and isinstance(a[0], Spec) else
                 next(metas) if isinstance(a, Spec) else a for a in args)
    outs = flat(op(*real))
    return OpCall(op, args, {}, ins, tuple(spec(tuple(o.shape), (R,) * len(mesh), mesh, o.dtype) for o in outs))


def pairs(strategies: list[Strategy]) -> set[tuple]:
    return {(s.inputs, s.outputs) for s in strategies}


# -- view / reshape --------------------------------------------------------------------------------
@st.composite
def regrouped(draw: st.DrawFn, shape: tuple[int, ...]) -> list[int]:
    """A shape with the same numel: adjacent dims merged or split, 1s added, or a random factorisation."""
    out = list(shape)
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["merge", "split", "one", "any"]))
        i = draw(st.integers(0, len(out) - 1))
        if kind == "merge" and i + 1 < len(out):
            out[i:i + 2] = [out[i] * out[i + 1]]
        elif kind == "split":
            f = draw(st.sampled_from([d for d in range(1, out[i] + 1) if out[i] % d == 0]))
            out[i:i + 1] = [f, out[i] // f]
        elif kind == "one":
            out.insert(i, 1)
        elif kind == "any":
            out, rest = [], math.prod(shape)
            while rest > 1 and len(out) < 3:
                out.append(draw(st.sampled_from([d for d in range(2, rest + 1) if rest % d == 0])))
                rest //= out[-1]
            out = out + [rest] if rest > 1 or not out else out
    if draw(st.booleans()):
        out[draw(st.integers(0, len(out) - 1))] = -1
    return out


PREFIXES: dict[str, Callable[[Any], Any]] = {
    "plain": lambda x: x, "transposed": lambda x: x.transpose(0, -1), "sliced": lambda x: x[..., ::2],
}


@given(case=sharded(), prefix=st.sampled_from(sorted(PREFIXES)), data_=st.data())
@SETTINGS
def test_view_and_reshape(case, prefix, data_) -> None:
    dims, shape, ps = case
    first = PREFIXES[prefix]
    seen = tuple(first(torch.empty(shape, device="meta")).shape)
    target = data_.draw(regrouped(seen))
    check(lambda x: first(x).reshape(target), dims, (data(shape), ps))
    if prefix == "plain":
        check(lambda x: x.view(target), dims, (data(shape), ps))


@given(case=sharded(max_dims=3), data_=st.data())
@SETTINGS
def test_expand(case, data_) -> None:
    dims, shape, ps = case
    base = tuple(1 if data_.draw(st.booleans()) else n for n in shape)  # some dims to broadcast
    lead = data_.draw(st.lists(st.integers(1, 3), max_size=2))
    size = lead + [data_.draw(st.integers(1, 4)) if b == 1 else data_.draw(st.sampled_from([b, -1]))
                   for b in base]
    check(lambda x: x.expand(size), dims, (data(base), ps))


@given(case=sharded(), data_=st.data())
@SETTINGS
def test_transpose_permute_t(case, data_) -> None:
    dims, shape, ps = case
    n = len(shape)
    a, b = data_.draw(st.integers(-n, n - 1)), data_.draw(st.integers(-n, n - 1))
    perm = data_.draw(st.permutations(range(n)))
    check(lambda x: (x.transpose(a, b), x.permute(perm), x.mT if n >= 2 else x.t(), x.T if n == 2 else x,
                     x.t() if n <= 2 else x), dims, (data(shape), ps))


@given(case=sharded(), data_=st.data())
@SETTINGS
def test_squeeze_unsqueeze(case, data_) -> None:
    dims, shape, ps = case
    n = len(shape)
    d = data_.draw(st.integers(-n, n - 1))
    several = data_.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    check(lambda x: (x.squeeze(), x.squeeze(d), x.squeeze(tuple(several)), x.unsqueeze(d), x.unsqueeze(-1),
                     x.unsqueeze(0).squeeze(0)), dims, (data(shape), ps))


# -- slice, select, split ------------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_slice_and_narrow(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(0, len(shape) - 1))
    bound = st.none() | st.integers(-8, 8)
    sel = slice(data_.draw(bound), data_.draw(bound), data_.draw(st.integers(1, 3)))
    start = data_.draw(st.integers(0, shape[d] - 1))
    length = data_.draw(st.integers(0, shape[d] - start))
    check(lambda x: (x[(slice(None),) * d + (sel,)], x.narrow(d, start, length), x.tensor_split(3, d)),
          dims, (data(shape), ps))


@given(case=sharded(), data_=st.data())
@SETTINGS
def test_select_unbind_split(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(0, len(shape) - 1))
    i = data_.draw(st.integers(-shape[d], shape[d] - 1))
    size = data_.draw(st.integers(1, shape[d]))
    cut = data_.draw(st.integers(0, shape[d]))
    check(lambda x: (x.select(d, i), *x.unbind(d), *x.split(size, d), *x.split([cut, shape[d] - cut], d),
                     *x.chunk(size, d)), dims, (data(shape), ps))


@given(case=sharded(partial=False), view_as=st.sampled_from([torch.int32, torch.float16, torch.float64]))
@SETTINGS
def test_view_dtype(case, view_as) -> None:
    dims, shape, ps = case
    if view_as == torch.float64 and shape[-1] % 2:
        shape = shape[:-1] + (shape[-1] + 1,)
    check(lambda x: x.view(view_as), dims, (data(shape), ps))


@given(case=sharded(max_dims=3), data_=st.data())
@SETTINGS
def test_view_chains(case, data_) -> None:
    """Views of views: local pieces that are themselves strided views of other pieces."""
    dims, shape, ps = case
    perm = data_.draw(st.permutations(range(len(shape))))
    check(lambda x: x.permute(perm).unsqueeze(1).flatten()[1:].view(-1, 1), dims, (data(shape), ps))
    check(lambda x: x.detach().t().contiguous().view(-1) if len(shape) == 2 else x.flatten(), dims, (data(shape), ps))


WRITES = {
    "slice off the shard": lambda x: x[:, 1:3].zero_(),
    "aligned slice of the shard": lambda x: x[1:3].fill_(7.0),
    "select through a transpose": lambda x: x.t()[2].mul_(2),
    "even view": lambda x: x.view(2, 12)[:, 5:].neg_(),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=list(WRITES))
def test_writes_through_local_views_reach_the_base(write) -> None:
    """A view that keeps the shard is a view of the local piece, so an in-place write lands in the base."""
    x = monarch.distribute_tensor(data((4, 6)), mesh_of({"x": 2}), [Shard(0)])
    want = data((4, 6))
    write(x), write(want)
    assert torch.equal(x.full_tensor(), want)


def test_writes_through_a_view_of_a_moved_base_are_refused() -> None:
    """A view whose base had to be gathered views a copy; writing through it would miss the base."""
    x = monarch.distribute_tensor(data((5,)), mesh_of({"x": 2}), [Shard(0)])
    with pytest.raises(monarch.UnsupportedOpError, match="redistribute the base first"):
        x[0:2] = 0  # pieces [0, 3) and [3, 5) do not slice into the output's pieces [0, 1) and [1, 2)
    y = x.redistribute([R])
    y[0:2] = 0  # replicated: the view needs no data movement, so the write reaches y
    want = data((5,))
    want[0:2] = 0
    assert torch.equal(y.full_tensor(), want)


ALIASED_WRITES = {  # an in-place op whose target must move (a Partial target of a replicated copy)
    "through a view": lambda x, v, src: v.copy_(src.view(12)),
    "into the base of a view": lambda x, v, src: x.copy_(src),
}


@pytest.mark.parametrize("write", ALIASED_WRITES.values(), ids=list(ALIASED_WRITES))
def test_writes_that_move_an_aliased_target_are_refused(write) -> None:
    """The write would land in a redistributed copy that the view (or the base) does not share: refused
    before anything runs; once the view is gone, the base alone may move and take the write."""
    mesh = mesh_of({"x": 2})
    x = monarch.distribute_tensor(data((3, 4)), mesh, [P])
    src = monarch.distribute_tensor(torch.ones(3, 4), mesh, [R])
    v = x.view(12)
    with pytest.raises(monarch.UnsupportedOpError, match="shares its data with a view or a base"):
        write(x, v, src)
    assert torch.equal(x.full_tensor(), data((3, 4))) and torch.equal(v.full_tensor(), data((12,)))
    del v
    x.copy_(src)
    assert torch.equal(x.full_tensor(), torch.ones(3, 4))


# -- collectives -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [{"x": 2}, {"dp": 2, "tp": 2}])
def test_transpose_of_a_shard_moves_nothing(dims) -> None:
    ps = (Shard(0),) * len(dims)
    y, comms = shipped(dims, lambda x: x.transpose(0, 1), (data((5, 3)), ps))
    assert comms == [] and y.placements == (Shard(1),) * len(dims)


@pytest.mark.parametrize("dims, shape, ps, view, want, comms", [
    ({"x": 2}, (4, 3), (Shard(0),), (12,), (Shard(0),), []),            # even merge of the outer dim
    ({"x": 2}, (3, 4), (Shard(0),), (12,), (R,), ["all_gather[x]"]),     # uneven: pieces do not align
    ({"x": 2}, (4, 3), (Shard(1),), (12,), (Shard(0),), ["all_to_all[x]"]),  # an inner dim: moved outer
    ({"x": 4}, (8,), (Shard(0),), (4, 2), (Shard(0),), []),             # even split
    ({"x": 4}, (8,), (Shard(0),), (2, 4), (R,), ["all_gather[x]"]),      # the outer part is too short
    ({"dp": 2, "tp": 2}, (8, 3), (Shard(0), Shard(0)), (24,), (Shard(0), Shard(0)), []),  # nested merge
    ({"dp": 2, "tp": 2}, (4, 6), (Shard(0), Shard(1)), (2, 2, 6), (Shard(0), Shard(2)), []),
    ({"dp": 2, "tp": 2}, (2, 6), (Shard(1), Shard(0)), (12,), (R, Shard(0)), ["all_gather[dp]"]),
])
def test_view_collectives(dims, shape, ps, view, want, comms) -> None:
    y, got = shipped(dims, lambda x: x.view(view), (data(shape), ps))
    assert (y.placements, got) == (want, comms)
    assert torch.equal(y.full_tensor(), data(shape).view(view))


@pytest.mark.parametrize("fn, shape, ps, want, comms", [
    (lambda x: x[:7], (8,), (Shard(0),), (Shard(0),), []),                    # exact: the last piece shrinks
    (lambda x: x[1:], (8,), (Shard(0),), (R,), ["all_gather[x]"]),
    (lambda x: x[:, 1:3], (4, 6), (Shard(0),), (Shard(0),), []),
    (lambda x: x[1], (4, 6), (Shard(1),), (Shard(0),), []),
    (lambda x: x.unsqueeze(0).expand(3, 4, 6), (4, 6), (Shard(1),), (Shard(2),), []),
    (lambda x: x.squeeze(), (3, 1, 5), (Shard(0),), (Shard(0),), []),          # a piece of size 1 stays
    (lambda x: x.split(2, 1)[1], (4, 6), (Shard(0),), (Shard(0),), []),
    (lambda x: x.permute(2, 0, 1), (2, 3, 4), (Shard(2),), (Shard(0),), []),
    (lambda x: x.unsqueeze(1), (4, 6), (P,), (P,), []),
])
def test_shape_op_collectives(fn, shape, ps, want, comms) -> None:
    y, got = shipped({"x": 2}, fn, (data(shape), ps))
    assert (y.placements, got) == (want, comms)
    assert torch.equal(y.full_tensor(), fn(data(shape)))


# -- rules and emitters on hand-built calls --------------------------------------------------------------
LINE = Extent(("x",), (2,))
GRID = Extent(("dp", "tp"), (2, 2))


def test_view_rule_offers_only_aligned_shards() -> None:
    x = spec((4, 3), (Shard(0),), LINE)
    even = OpCall(aten.view.default, (x, [12]), {}, (x,), (spec((12,), (R,), LINE),))
    assert ((Shard(0),), (Shard(0),)) in pairs(RULES[aten.view.default](even, 0))
    x = spec((3, 4), (Shard(0),), LINE)
    uneven = OpCall(aten.view.default, (x, [12]), {}, (x,), (spec((12,), (R,), LINE),))
    assert pairs(RULES[aten.view.default](uneven, 0)) == {((R,), (R,))}  # listed for its emitter


def test_transpose_rule_swaps_dims_and_passes_partial() -> None:
    x = spec((4, 6, 2), (P,), LINE)
    call = op_call(aten.transpose.int, (x, 0, 2), (x,), LINE)
    assert pairs(RULES[aten.transpose.int](call, 0)) == {
        ((Shard(0),), (Shard(2),)), ((Shard(1),), (Shard(1),)), ((Shard(2),), (Shard(0),)), ((P,), (P,))}


def test_aligned_checks_every_nesting() -> None:
    """(4,) -> (2, 2) over 2x2: either mesh dim alone may shard dim 0 evenly, but not both together."""
    def blocks(a, b):
        return (a[0], a[1]) == (b[0] * 2, b[1] * 2)
    x = spec((4, 6), (R, Shard(0)), GRID)
    assert aligned(x, 0, 2, 1, blocks)          # tp shards dim 0 now: it is admitted first
    assert not aligned(x, 0, 2, 0, blocks)      # dp would nest with it: refused
    assert aligned(spec((4, 6), (R, R), GRID), 0, 2, 0, blocks)


def test_slice_emitter_gives_each_rank_its_local_bounds() -> None:
    x = spec((8,), (Shard(0),), LINE)
    call = op_call(aten.slice.Tensor, (x, 0, 0, 7, 1), (x,), LINE)
    (strategy,) = [s for s in RULES[aten.slice.Tensor](call, 0) if s.inputs == (Shard(0),)]
    out = call.outs[0].with_placements((Shard(0),))
    locals_ = [strategy.emit(Emit(call, (x,), (out,), (r,), (Buf(1), 0, 0, 7, 1), {}, (2,), lambda: -1))
               for r in range(2)]
    assert [loc[0].args[1:] for loc in locals_] == [(0, 0, 4, 1), (0, 0, 3, 1)]


def test_view_emitter_uses_local_sizes() -> None:
    x = spec((4, 3), (Shard(0),), LINE)
    call = OpCall(aten.view.default, (x, [-1]), {}, (x,), (spec((12,), (R,), LINE),))
    (strategy,) = [s for s in RULES[aten.view.default](call, 0) if s.inputs == (Shard(0),)]
    out = call.outs[0].with_placements((Shard(0),))
    (local,) = strategy.emit(Emit(call, (x,), (out,), (1,), (Buf(1), [-1]), {}, (2,), lambda: -1))
    assert (local.op, local.args) == ("aten::reshape", (Buf(1), [6]))  # a piece may not view as the whole
