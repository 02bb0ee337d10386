"""Sharding rules of the strided and diagonal view ops, in-place views and the unsafe and copying splits
(monarch/graph/rules/view.py) on the in-process reference mesh, and a few on a real 4-process mesh.

Values equal plain torch exactly on random (uneven, nested, Partial) placements under MONARCH_STRICT=1;
key cases pin the collectives (a diagonal or flip of other dims moves nothing, a reversed shard is gathered).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_rules_view import LINE, SETTINGS, check, data, mesh_of, op_call, pairs, sharded, shipped, spec

import monarch
from monarch.graph.rules.table import RULES
from monarch.tensor import MeshTensor, Partial, Replicate, Shard

aten, prims = torch.ops.aten, torch.ops.prims
R, P = Replicate(), Partial("sum")
pytestmark = pytest.mark.usefixtures("strict")


def two_dims(draw: Any, n: int) -> tuple[int, int]:
    """Two distinct dims of an n-dim tensor, each as a non-negative or a negative index."""
    a, b = draw(st.sampled_from([(i, j) for i in range(n) for j in range(n) if i != j]))
    return a - n * draw(st.booleans()), b - n * draw(st.booleans())


# -- diagonal, trace ---------------------------------------------------------------------------------
@given(case=sharded(min_dims=2), data_=st.data())
@SETTINGS
def test_diagonal_and_its_copy(case, data_) -> None:
    dims, shape, ps = case
    d1, d2 = two_dims(data_.draw, len(shape))
    off = data_.draw(st.integers(-shape[d1], shape[d2]))
    check(lambda x: (torch.diagonal(x, off, d1, d2), torch.diagonal_copy(x, off, d1, d2),
                     torch.linalg.diagonal(x, offset=off, dim1=d1, dim2=d2)), dims, (data(shape), ps))


@given(case=sharded(min_dims=2, max_dims=2))
@SETTINGS
def test_trace(case) -> None:
    dims, shape, ps = case
    check(torch.trace, dims, (data(shape), ps))


@given(case=sharded(min_dims=2), data_=st.data())
@SETTINGS
def test_diagonal_scatter(case, data_) -> None:
    dims, shape, ps = case
    d1, d2 = two_dims(data_.draw, len(shape))
    off = data_.draw(st.integers(-shape[d1] + 1, shape[d2] - 1))
    src = -data(tuple(torch.empty(shape, device="meta").diagonal(off, d1, d2).shape))
    src_ps = tuple(data_.draw(st.sampled_from([R, P, *(Shard(k) for k in range(src.ndim))])) for _ in ps)
    check(lambda x, s: torch.diagonal_scatter(x, s, off, d1, d2), dims, (data(shape), ps), (src, src_ps))


@given(case=sharded(min_dims=1, max_dims=3), data_=st.data())
@SETTINGS
def test_diagonal_backward(case, data_) -> None:
    """The gradient of diagonal: the gradient's dims keep their shards on the zeros sized per rank."""
    dims, grad_shape, ps = case
    n = len(grad_shape) + 1
    d1, d2 = two_dims(data_.draw, n)
    size = grad_shape[-1]
    sizes = [0] * n
    rest = iter(grad_shape[:-1])
    for k in range(n):
        sizes[k] = size if k in (d1 % n, d2 % n) else next(rest)
    check(lambda g: aten.diagonal_backward(g, sizes, 0, d1, d2), dims, (data(grad_shape), ps))


# -- unfold --------------------------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_unfold_and_its_copy_and_backward(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(-len(shape), len(shape) - 1))
    size = data_.draw(st.integers(1, shape[d]))
    step = data_.draw(st.integers(1, 3))
    check(lambda x: (x.unfold(d, size, step), torch.unfold_copy(x, d, size, step)), dims, (data(shape), ps))
    windows = tuple(torch.empty(shape, device="meta").unfold(d, size, step).shape)
    check(lambda g: aten.unfold_backward(g, list(shape), d, size, step), dims, (data(windows), ps))


# -- flip (prims.rev) ------------------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_flips(case, data_) -> None:
    dims, shape, ps = case
    n = len(shape)
    flipped = data_.draw(st.lists(st.integers(-n, n - 1), max_size=n, unique_by=lambda d: d % n))
    fns = [lambda x: x.flip(flipped), lambda x: torch.flipud(x)]
    if n >= 2:
        k, plane = data_.draw(st.integers(-4, 4)), two_dims(data_.draw, n)
        fns += [torch.fliplr, lambda x: torch.rot90(x, k, plane)]
    check(lambda x: tuple(f(x) for f in fns), dims, (data(shape), ps))


def test_rev_rule_keeps_other_shards_and_partial() -> None:
    x = spec((4, 6, 2), (P,), LINE)
    call = op_call(prims.rev.default, (x, [0, 2]), (x,), LINE)
    assert pairs(RULES[prims.rev.default](call, 0)) == {((Shard(1),), (Shard(1),)), ((P,), (P,))}


# -- as_strided ------------------------------------------------------------------------------------------
@st.composite
def strided_views(draw: Any, numel: int) -> tuple[list[int], list[int], int]:
    """(size, stride, storage_offset) of a view inside a storage of numel elements (overlaps allowed)."""
    size = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    stride = [draw(st.integers(0, 4)) for _ in size]
    reach = sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if reach >= numel:
        size, stride, reach = [1], [1], 0
    return size, stride, draw(st.integers(0, numel - 1 - reach))


@given(case=sharded(max_dims=3), transposed=st.booleans(), data_=st.data())
@SETTINGS
def test_as_strided_and_its_copy_and_scatter(case, transposed, data_) -> None:
    """On the tensor's global layout, also through a transpose (whose gathered pieces are laid out otherwise)."""
    dims, shape, ps = case
    numel = torch.Size(shape).numel()
    size, stride, off = data_.draw(strided_views(numel))
    first = (lambda x: x.transpose(0, -1)) if transposed else (lambda x: x)
    check(lambda x: (first(x).as_strided(size, stride, off), torch.as_strided_copy(first(x), size, stride, off)),
          dims, (data(shape), ps))
    src = -data(tuple(size))
    if torch.arange(numel).as_strided(size, stride, off).unique().numel() == src.numel():  # no self-overlap
        check(lambda x, s: torch.as_strided_scatter(first(x), s, size, stride, off), dims, (data(shape), ps),
              (src, (R,) * len(ps)))


def test_writes_through_as_strided_are_refused() -> None:
    """Each rank's as_strided views a copy of its piece laid out as the global tensor, never the base."""
    x = monarch.distribute_tensor(data((4, 3)), mesh_of({"x": 2}), [R])
    with pytest.raises(monarch.UnsupportedOpError, match="would not reach the base"):
        x.as_strided([2, 2], [3, 1], 1).zero_()


# -- in-place views ------------------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_in_place_views(case, data_) -> None:
    dims, shape, ps = case
    n = len(shape)
    d = data_.draw(st.integers(-n, n - 1))
    a, b = data_.draw(st.integers(-n, n - 1)), data_.draw(st.integers(-n, n - 1))

    def chain(x: Any) -> Any:
        y = x.clone()
        y.unsqueeze_(d).squeeze_(d).transpose_(a, b).unsqueeze_(0).squeeze_()
        z = x.clone()
        z.swapdims_(a, b).squeeze_((a % n,))
        return y, z, x.clone().t_() if n <= 2 else x
    check(chain, dims, (data(shape), ps))


@pytest.mark.parametrize("dims", [{"x": 2}, {"dp": 2, "tp": 2}])
def test_in_place_views_move_nothing_and_writes_after_them_reach_the_base(dims) -> None:
    ps = (Shard(2),) * len(dims)
    want = data((3, 1, 5))

    def fn(x: MeshTensor) -> Any:
        base = x.clone()
        v = base.unsqueeze(0)
        v.squeeze_(0).squeeze_(1).t_()
        v.mul_(2)
        return base, v
    (base, v), comms = shipped(dims, fn, (want, ps))
    assert comms == [] and v.placements == (Shard(0),) * len(dims)
    assert torch.equal(base.full_tensor(), want * 2) and torch.equal(v.full_tensor(), (want * 2)[:, 0].t())


# -- unsafe and copying splits -------------------------------------------------------------------------
@given(case=sharded(), data_=st.data())
@SETTINGS
def test_unsafe_and_copying_splits(case, data_) -> None:
    dims, shape, ps = case
    d = data_.draw(st.integers(0, len(shape) - 1))
    size = data_.draw(st.integers(1, shape[d]))
    cut = data_.draw(st.integers(0, shape[d]))
    sizes = [cut, shape[d] - cut]
    check(lambda x: (*x.unsafe_split(size, d), *torch.unsafe_split_with_sizes(x, sizes, d), *x.unsafe_chunk(size, d),
                     *torch.split_with_sizes_copy(x, sizes, d), *torch.unbind_copy(x, d)), dims, (data(shape), ps))


# -- decompositions ending in a view of a moved temporary --------------------------------------------------
@pytest.mark.parametrize("dims", [{"x": 4}, {"dp": 2, "tp": 2}])
def test_repeat_output_takes_writes(dims) -> None:
    """repeat decomposes into a reshape that gathers its (uneven) input first; its output is its own."""
    x = monarch.distribute_tensor(data((5,)), mesh_of(dims), [Shard(0)] * len(dims))
    y = x.repeat(3)
    y.add_(1)
    assert torch.equal(y.full_tensor(), data((5,)).repeat(3) + 1)


def instance_norm_case(mesh: Any, ps: list) -> None:
    """F.instance_norm with running stats on sharded inputs: output and running stats equal torch."""
    x, mean, var = data((3, 5, 4)) / 7, torch.arange(5.0), torch.arange(1.0, 6.0)
    w, b = torch.arange(5.0) / 3, -torch.arange(5.0)
    stats = [monarch.distribute_tensor(t.clone(), mesh, [Shard(0)] * len(ps)) for t in (mean, var)]
    want = F.instance_norm(x, mean, var, w, b, use_input_stats=True, momentum=0.3)  # updates mean and var
    dx = monarch.distribute_tensor(x, mesh, ps)
    got = F.instance_norm(dx, *stats, monarch.distribute_tensor(w, mesh, [R] * len(ps)),
                          monarch.distribute_tensor(b, mesh, [Shard(0)] * len(ps)), use_input_stats=True, momentum=0.3)
    torch.testing.assert_close(got.full_tensor(), want)
    torch.testing.assert_close(stats[0].full_tensor(), mean)
    torch.testing.assert_close(stats[1].full_tensor(), var)


@pytest.mark.parametrize("ps", [[Shard(1), Shard(0)], [Shard(2), Shard(1)], [P, Shard(0)]])
def test_instance_norm_with_running_stats(ps) -> None:
    instance_norm_case(mesh_of({"dp": 2, "tp": 2}), ps)


# -- collectives ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, shape, ps, want, comms", [
    (lambda x: x.diagonal(0, 1, 2), (4, 5, 5), (Shard(0),), (Shard(0),), []),
    (lambda x: x.diagonal(1, -1, 0), (5, 3, 5), (Shard(1),), (Shard(0),), []),
    (lambda x: x.diagonal(), (5, 5), (Shard(0),), (Shard(0),), []),            # rows [0, 3) hold entries [0, 3)
    (lambda x: x.diagonal(1), (6, 6), (Shard(0),), (Shard(0),), []),           # 5 entries: [0, 3) and [3, 5)
    (lambda x: x.diagonal(-1), (6, 6), (Shard(1),), (Shard(0),), []),          # columns alike
    (lambda x: x.diagonal(1, 1, 0), (6, 6), (Shard(1),), (Shard(0),), []),     # dim1 is any dim
    (lambda x: x.diagonal(-2), (6, 6), (Shard(0),), (R,), ["all_gather[x]"]),  # rows [0, 3) hold only [0, 1)
    (torch.trace, (6, 6), (Shard(0),), (P,), []),                              # each rank sums its entries
    (lambda x: x.flip(0), (4, 6), (Shard(1),), (Shard(1),), []),
    (lambda x: x.flip(1), (4, 6), (Shard(1),), (Shard(0),), ["all_to_all[x]"]),  # moved to a kept dim
    (lambda x: x.unfold(1, 2, 1), (4, 6), (Shard(0),), (Shard(0),), []),
    (lambda x: x.unfold(1, 2, 3), (4, 6), (Shard(1),), (Shard(1),), []),      # windows [0, 2) and [3, 5)
    (lambda x: x.unfold(0, 2, 1), (4, 6), (Shard(0),), (Shard(1),), ["all_to_all[x]"]),  # windows overlap
    (lambda x: x.unfold(0, 2, 2), (4, 6), (P,), (P,), []),
    (lambda x: x.as_strided([2, 2], [1, 2], 1), (4, 6), (P,), (P,), []),
])
def test_collectives(fn, shape, ps, want, comms) -> None:
    y, got = shipped({"x": 2}, fn, (data(shape), ps))
    assert (y.placements, got) == (want, comms)
    assert torch.equal(y.full_tensor(), fn(data(shape)))


GRADIENTS = {
    "diagonal of rows": (lambda x: x.diagonal(1, 0, 1), (6, 6, 3), [Shard(0), Shard(2)]),
    "diagonal of batches": (lambda x: x.diagonal(0, -2, -1), (3, 5, 5), [Shard(0), Shard(1)]),
    "unfold": (lambda x: x.unfold(1, 3, 2), (5, 7), [Shard(0), Shard(1)]),
    "flip": (lambda x: x.flip(0, 1), (5, 7), [Shard(1), Shard(0)]),
    "as_strided": (lambda x: x.as_strided([3, 3], [1, 2], 2), (5, 7), [Shard(1), Shard(0)]),
}


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_gradients(name) -> None:
    """Backward through each view (diagonal_backward, unfold_backward, as_strided's) equals plain torch."""
    fn, shape, ps = GRADIENTS[name]
    plain = data(shape).requires_grad_()
    (fn(plain) * fn(data(shape))).sum().backward()
    x = monarch.distribute_tensor(data(shape), mesh_of({"dp": 2, "tp": 2}), ps).requires_grad_()
    (fn(x) * fn(data(shape))).sum().backward()
    assert torch.equal(x.grad.full_tensor(), plain.grad)


# -- a real mesh -----------------------------------------------------------------------------------------
def test_on_a_real_mesh(procs) -> None:
    """Diagonal, flip, unfold, as_strided, in-place squeeze_ and instance norm on 4 processes."""
    a = data((3, 5, 5))
    x = monarch.distribute_tensor(a, procs, [Shard(0), Shard(2)])
    y = x.clone()
    y.unsqueeze_(1).squeeze_(1)
    outs = [x.diagonal(1, 1, 2), x.flip(2), x.unfold(1, 2, 2), x.as_strided([2, 3], [2, 5], 4), y]
    wants = [a.diagonal(1, 1, 2), a.flip(2), a.unfold(1, 2, 2), a.as_strided([2, 3], [2, 5], 4), a]
    for got, want in zip(outs, wants, strict=True):
        assert torch.equal(got.full_tensor(), want)
    instance_norm_case(procs, [Shard(1), Shard(0)])
