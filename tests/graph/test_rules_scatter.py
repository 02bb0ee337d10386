"""Scatter-like, grid-sampling and segment rules (graph/rules/index.py) against plain torch.

Random shapes (uneven and empty pieces) and placements (Partial included) on the in-process mesh under
MONARCH_STRICT=1; the placements and collectives of the key cases; autograd through the ops; the rules'
algebra on hand-built specs; and the key cases again on a real 4-process mesh.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.graph.rules.table import RULES, OpCall, Strategy
from monarch.runtime.session.session import session_of
from monarch.shape import Extent
from monarch.tensor.spec import Spec
from tests.graph.rule_cases import Case, examples
from tests.strategies import reference_mesh, tensor_shapes

aten = torch.ops.aten
R, P, MAX, PROD = Replicate(), Partial("sum"), Partial("max"), Partial("prod")
pytestmark = pytest.mark.usefixtures("strict")
SCATTERS: dict[str, Callable[..., Any]] = {
    "src": lambda x, d, i, s: torch.scatter(x, d, i, s),
    "value": lambda x, d, i, s: torch.scatter(x, d, i, 1.5),
    "add": lambda x, d, i, s: torch.scatter(x, d, i, s, reduce="add"),
    "multiply": lambda x, d, i, s: torch.scatter(x, d, i, s, reduce="multiply"),
    "value_add": lambda x, d, i, s: torch.scatter(x, d, i, 1.5, reduce="add"),
    "value_multiply": lambda x, d, i, s: torch.scatter(x, d, i, 1.5, reduce="multiply"),
    "scatter_add": lambda x, d, i, s: torch.scatter_add(x, d, i, s),
    "inplace_add": lambda x, d, i, s: x.clone().scatter_add_(d, i, s),
    **{f"{r}_{inc}": (lambda r, inc: lambda x, d, i, s: torch.scatter_reduce(x, d, i, s, r, include_self=inc))(r, inc)
       for r in ("sum", "prod", "mean", "amax", "amin") for inc in (True, False)},
}


def ints(high: int, shape: tuple[int, ...], gen: torch.Generator, low: int = 0) -> torch.Tensor:
    return torch.randint(low, max(high, low + 1), shape, generator=gen)


def smaller(data: st.DataObject, n: int) -> int:
    """n, or a smaller size (an index or src may fall short of self on a dim)."""
    return data.draw(st.sampled_from([n, max(1, n - 1)]))


# -- random cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(SCATTERS))
@examples(12)
def test_scatter(variant: str, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 6))
    dim = data.draw(st.integers(0, len(shape) - 1))
    ishape = tuple(data.draw(st.integers(0, 6)) if k == dim else smaller(data, n) for k, n in enumerate(shape))
    sshape = tuple(n + data.draw(st.integers(0, 1)) for n in ishape)
    index = ints(shape[dim], ishape, c.gen)
    c.run(lambda x, i, s: SCATTERS[variant](x, dim, i, s), c.randn(*shape), index, c.randn(*sshape))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@examples(12)
def test_index_reduce(reduce: str, include_self: bool, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 6))
    dim = data.draw(st.integers(0, len(shape) - 1))
    n = data.draw(st.integers(0, 7))
    source = c.randn(*(n if k == dim else s for k, s in enumerate(shape)))
    c.run(lambda x, i, s: x.index_reduce(dim, i, s, reduce, include_self=include_self),
          c.randn(*shape), ints(shape[dim], (n,), c.gen), source)


@pytest.mark.parametrize("accumulate", [True, False])
@examples(25)
def test_put(accumulate: bool, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 5))
    numel = torch.Size(shape).numel()
    ishape = data.draw(tensor_shapes(1, 2, 0, 5))
    index = ints(numel, ishape, c.gen, low=-numel)
    if not accumulate:  # an overwrite with duplicate indices picks any writer: distinct ones, some negative
        index = torch.randperm(numel, generator=c.gen)[:index.numel()]
        index, ishape = index - numel * (index % 2), tuple(index.shape)
    flat = data.draw(st.booleans())
    source = c.randn(index.numel()) if flat else c.randn(*ishape)
    c.run(lambda x, i, s: x.put(i, s, accumulate=accumulate), c.randn(*shape), index, source)


@examples(30)
def test_masked_scatter(data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 5))
    mshape = shape[data.draw(st.integers(0, len(shape) - 1)):]
    mask = torch.rand(mshape, generator=c.gen) > 0.5
    source = c.randn(torch.Size(shape).numel() + data.draw(st.integers(0, 2)))
    c.run(lambda x, m, s: x.masked_scatter(m, s), c.randn(*shape), mask, source)


def _grid_shapes(data: st.DataObject, spatial: int, most: int) -> tuple[int, int, list[int], list[int]]:
    """Batch, channels, input and output spatial sizes of a grid sample (each side at most `most`)."""
    n, ch = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    return n, ch, [data.draw(st.integers(1, most)) for _ in range(spatial)], \
        [data.draw(st.integers(1, most)) for _ in range(spatial)]


@pytest.mark.parametrize("spatial", [2, 3])
@examples(25)
def test_grid_sample(spatial: int, data: st.DataObject) -> None:
    c = Case(data)
    n, ch, size, out = _grid_shapes(data, spatial, 5)
    modes = ["bilinear", "nearest"] + (["bicubic"] if spatial == 2 else [])
    mode = data.draw(st.sampled_from(modes))
    padding = data.draw(st.sampled_from(["zeros", "border", "reflection"]))
    corners = data.draw(st.booleans())
    grid = torch.rand((n, *out, spatial), generator=c.gen) * 2.4 - 1.2
    c.run(lambda x, g: F.grid_sample(x, g, mode, padding, corners), c.randn(n, ch, *size), grid)


@pytest.mark.parametrize("spatial", [2, 3])
@examples(25)
def test_grid_sampler_backward(spatial: int, data: st.DataObject) -> None:
    c = Case(data)
    n, ch, size, out = _grid_shapes(data, spatial, 4)
    mode, padding, corners = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 2)), data.draw(st.booleans())
    mask = [data.draw(st.booleans()), True]
    op = aten.grid_sampler_2d_backward if spatial == 2 else aten.grid_sampler_3d_backward
    grid = torch.rand((n, *out, spatial), generator=c.gen) * 2.4 - 1.2

    def fn(g: Any, x: Any, grid: Any) -> Any:
        return tuple(t for t in op(g, x, grid, mode, padding, corners, mask) if t is not None)
    c.run(fn, c.randn(n, ch, *out), c.randn(n, ch, *size), grid)


def segments(c: Case, lead: tuple[int, ...], length: int, count: int) -> torch.Tensor:
    """Lengths of `count` segments (some empty) covering `length`, for every index of the leading dims."""
    cuts = torch.randint(0, length + 1, (*lead, max(count - 1, 0)), generator=c.gen).sort(-1).values
    edges = torch.cat([torch.zeros(*lead, 1, dtype=torch.long), cuts, torch.full((*lead, 1), length)], -1)
    return edges.diff(dim=-1)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("form", ["lengths", "offsets"])
@examples(15)
def test_segment_reduce(reduce: str, form: str, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 5))
    axis = data.draw(st.integers(0, len(shape) - 1))
    lengths = segments(c, shape[:axis], shape[axis], data.draw(st.integers(1, 4)))
    seg = {"lengths": lengths} if form == "lengths" else {"offsets": F.pad(lengths.cumsum(-1), (1, 0))}
    initial = data.draw(st.sampled_from([None, 0.5]))
    x = c.randn(*shape)

    def forward(x: Any, s: Any) -> Any:
        return torch.segment_reduce(x, reduce, axis=axis, initial=initial, **{form: s})
    c.run(forward, x, seg[form])
    if reduce != "prod":  # its backward divides by the data (inf where a value is 0)
        out, grad = forward(x, seg[form]), c.randn(*forward(x, seg[form]).shape)
        c.run(lambda g, o, x, s: aten._segment_reduce_backward(g, o, x, reduce, axis=axis, initial=initial,
                                                               **{form: s}), grad, out, x, seg[form])


# -- placements and collectives --------------------------------------------------------------------
def placed(mesh: Any, fn: Callable[..., Any], *inputs: tuple[torch.Tensor, list],
           timeout: float = 30) -> tuple[Any, list[str]]:
    """fn on the inputs distributed as given: its output (checked against plain torch) and the
    collectives its ops shipped (the fetch not counted)."""
    xs = [monarch.distribute_tensor(t, mesh, ps) for t, ps in inputs]
    s = session_of(mesh)
    s.flush()
    before = len(s.collectives)
    out = fn(*xs)
    s.flush()
    comms = s.collectives[before:]
    torch.testing.assert_close(out.full_tensor(timeout=timeout), fn(*(t for t, _ in inputs)), equal_nan=True)
    return out, comms


def scatter_cases(gen: torch.Generator) -> list[tuple[str, Callable[..., Any], list, tuple]]:
    """(name, fn, its inputs with placements, the output placements it keeps without moving data)."""
    x, i, s = torch.randn(6, 5, generator=gen), ints(6, (4, 5), gen), torch.randn(4, 5, generator=gen)
    along = [(x, [R, R]), (i, [Shard(0), R]), (s, [Shard(0), R])]
    across = [(x, [Shard(1), R]), (i, [Shard(1), R]), (s, [Shard(1), R])]
    grid_in, grid = torch.randn(4, 3, 5, 6, generator=gen), torch.rand(4, 7, 3, 2, generator=gen) * 2 - 1
    data, lengths = torch.randn(4, 9, 3, generator=gen), torch.tensor([[4, 0, 5]] * 4)
    ir_i, ir_s = ints(6, (7,), gen), torch.randn(7, 5, generator=gen)
    return [
        ("scatter_add split", lambda x, i, s: x.scatter_add(0, i, s), along, (P, R)),
        ("scatter_add across", lambda x, i, s: x.scatter_add(0, i, s), across, (Shard(1), R)),
        ("amax split", lambda x, i, s: x.scatter_reduce(0, i, s, "amax"), along, (MAX, R)),
        ("prod split", lambda x, i, s: x.scatter_reduce(0, i, s, "prod"), along, (PROD, R)),
        ("index_reduce amin split", lambda x, i, s: x.index_reduce(0, i, s, "amin"),
         [(x, [R, Shard(1)]), (ir_i, [Shard(0), R]), (ir_s, [Shard(0), Shard(1)])], (Partial("min"), Shard(1))),
        ("put accumulate", lambda x, i, s: x.put(i, s, accumulate=True), along, (P, R)),
        ("grid_sample", lambda x, g: F.grid_sample(x, g, align_corners=True),
         [(grid_in, [Shard(0), Shard(1)]), (grid, [Shard(0), R])], (Shard(0), Shard(1))),
        ("grid_sample spatial", lambda x, g: F.grid_sample(x, g, align_corners=False),
         [(grid_in, [R, R]), (grid, [Shard(1), Shard(2)])], (Shard(2), Shard(3))),
        ("segment_reduce", lambda d, n: torch.segment_reduce(d, "max", lengths=n, axis=1, initial=0.0),
         [(data, [Shard(0), Shard(2)]), (lengths, [Shard(0), R])], (Shard(0), Shard(2))),
    ]


CASES = scatter_cases(torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,fn,inputs,want", CASES, ids=[c[0] for c in CASES])
def test_stays_sharded_without_moving_data(name: str, fn: Any, inputs: list, want: tuple) -> None:
    out, comms = placed(reference_mesh({"dp": 2, "tp": 2}), fn, *inputs)
    assert out.placements == want and comms == [], (out.placements, comms)


def test_reductions_without_self_gather_the_scatter_dim() -> None:
    """include_self=False (and mean) have no Partial that joins split contributions: the index is gathered."""
    gen = torch.Generator().manual_seed(1)
    x, i, s = torch.randn(6, 5, generator=gen), ints(6, (4, 3), gen), torch.randn(4, 3, generator=gen)
    for reduce, inc in (("amax", False), ("sum", False), ("mean", True)):
        out, comms = placed(reference_mesh({"x": 4}),
                            lambda x, i, s: x.scatter_reduce(0, i, s, reduce, include_self=inc),
                            (x, [R]), (i, [Shard(0)]), (s, [Shard(0)]))
        assert out.placements == (R,) and comms == ["all_gather[x]"] * 2, (reduce, out.placements, comms)


def test_max_partial_passes_through_amax() -> None:
    """amax over a sharded dim gives P(max); a scatter_reduce amax of it keeps it without a collective."""
    gen = torch.Generator().manual_seed(2)
    x, i, s = torch.randn(4, 6, 5, generator=gen), ints(6, (3, 5), gen), torch.randn(3, 5, generator=gen)
    for inc in (True, False):
        out, comms = placed(reference_mesh({"x": 4}),
                            lambda x, i, s: x.amax(0).scatter_reduce(0, i, s, "amax", include_self=inc),
                            (x, [Shard(0)]), (i, [R]), (s, [R]))
        assert out.placements == (MAX,) and comms == [], (out.placements, comms)


def test_adding_ops_pass_only_sum_partials() -> None:
    """index_add and accumulating index_put of two P(max) operands: the pieces' sums are not the sum of
    their maxima, so the operands are reduced first (an overwriting index_put keeps P(max))."""
    gen = torch.Generator().manual_seed(4)
    x, y, i = torch.randn(2, 4, 3, generator=gen), torch.randn(2, 2, 3, generator=gen), torch.tensor([0, 2])
    mesh = reference_mesh({"x": 2})
    out, _ = placed(mesh, lambda x, y, i: x.amax(0).index_add(0, i, y.amax(0)), (x, [Shard(0)]), (y, [Shard(0)]),
                    (i, [R]))
    assert out.placements != (MAX,)
    for accumulate in (True, False):
        out, _ = placed(mesh, lambda x, y, i: torch.index_put(x.amax(0), (i,), y.amax(0), accumulate),
                        (x, [Shard(0)]), (y, [Shard(0)]), (i, [R]))
        assert (out.placements == (MAX,)) != accumulate, (accumulate, out.placements)


def test_empty_pieces() -> None:
    """Most of the 4 ranks hold nothing of a size-1 or size-2 dim; every rank still gives the right result."""
    gen = torch.Generator().manual_seed(3)
    x, i, s = torch.randn(3, 2, generator=gen), ints(3, (1, 2), gen), torch.randn(1, 2, generator=gen)
    mesh = reference_mesh({"x": 4})
    for reduce in ("sum", "prod", "amax", "amin", "mean"):
        placed(mesh, lambda x, i, s: x.scatter_reduce(0, i, s, reduce), (x, [R]), (i, [Shard(0)]), (s, [Shard(0)]))
        placed(mesh, lambda x, i, s: x.scatter_reduce(0, i, s, reduce), (x, [Shard(1)]), (i, [Shard(1)]),
               (s, [Shard(1)]))
    placed(mesh, lambda x, i, s: x.index_reduce(0, i, s, "amax"), (x, [R]), (i.reshape(2)[:1], [Shard(0)]),
           (s, [Shard(0)]))
    data = torch.randn(2, 0, 3, generator=gen)
    placed(mesh, lambda d, n: torch.segment_reduce(d, "sum", lengths=n, axis=1),
           (data, [Shard(2)]), (torch.zeros(2, 2, dtype=torch.long), [R]))


def grads_of(mesh: Any, fn: Callable[..., Any], *inputs: tuple[torch.Tensor, list]) -> None:
    """fn's output and the gradients of a weighted sum of it equal plain torch's (floating inputs)."""
    plain = [t.clone().requires_grad_(t.is_floating_point()) for t, _ in inputs]
    placed_ = [monarch.distribute_tensor(t, mesh, ps) for t, (_, ps) in zip(plain, inputs, strict=True)]
    want = fn(*plain)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (want * weight).sum().backward()
    got = fn(*placed_)
    torch.testing.assert_close(got.full_tensor(timeout=30), want, equal_nan=True)
    (got * monarch.distribute_tensor(weight, mesh, [R] * len(mesh.sizes))).sum().backward()
    for m, t in zip(placed_, plain, strict=True):
        if t.requires_grad:
            torch.testing.assert_close(m.grad.full_tensor(timeout=30), t.grad)


def test_backward() -> None:
    """Each op's autograd backward runs sharded (strict: every op it reaches has a rule)."""
    gen = torch.Generator().manual_seed(6)
    mesh = reference_mesh({"dp": 2, "tp": 2})
    x, i, s = torch.randn(6, 5, generator=gen), ints(6, (4, 5), gen), torch.randn(4, 5, generator=gen)
    grid_in, grid = torch.randn(4, 3, 5, 6, generator=gen), torch.rand(4, 7, 3, 2, generator=gen) * 2 - 1
    grads_of(mesh, lambda x, g: F.grid_sample(x, g, align_corners=False), (grid_in, [Shard(0), Shard(1)]),
             (grid, [R, Shard(1)]))
    mask = torch.rand(6, 5, generator=gen) > 0.5
    grads_of(mesh, lambda x, m, s: x.masked_scatter(m, s), (x, [Shard(0), R]), (mask, [R, Shard(1)]),
             (torch.randn(31, generator=gen), [Shard(0), R]))
    for reduce in ("sum", "amax", "mean"):
        grads_of(mesh, lambda x, i, s: x.scatter_reduce(0, i, s, reduce), (x, [R, Shard(1)]), (i, [Shard(0), R]),
                 (s, [Shard(0), R]))
    data, lengths = torch.randn(4, 9, 3, generator=gen), torch.tensor([[4, 0, 5]] * 4)
    grads_of(mesh, lambda d, n: torch.segment_reduce(d, "mean", lengths=n, axis=1, initial=0.0),
             (data, [Shard(0), Shard(2)]), (lengths, [Shard(0), R]))


# -- the rules on hand-built specs -----------------------------------------------------------------
def call_of(op: Any, args: tuple, *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> OpCall:
    mesh = Extent(("x",), (4,))
    specs = [Spec(s, tuple(torch.empty(s, device="meta").stride()), torch.int64 if k == 1 else dtype, (R,), mesh)
             for k, s in enumerate(shapes)]
    it = iter(specs)
    return OpCall(op, tuple(next(it) if a is Spec else a for a in args), {}, tuple(specs), (specs[0],))


def offered(call: OpCall) -> list[Strategy]:
    return RULES[call.op](call, 0)


def test_rule_never_shards_the_scatter_dim_of_self() -> None:
    call = call_of(aten.scatter_reduce.two, (Spec, 1, Spec, Spec, "sum"), (6, 5), (6, 5), (6, 5))
    assert all(s.inputs[0] != Shard(1) for s in offered(call))
    assert Strategy((Shard(0),) * 3, (Shard(0),)) in offered(call)


def test_rule_shards_a_dim_only_where_index_and_src_match_self() -> None:
    short = call_of(aten.scatter.src, (Spec, 0, Spec, Spec), (6, 5), (4, 4), (4, 5))
    assert not any(isinstance(s.outputs[0], Shard) for s in offered(short))
    wide_src = call_of(aten.scatter.src, (Spec, 0, Spec, Spec), (6, 5), (4, 5), (4, 6))
    assert not any(isinstance(s.outputs[0], Shard) for s in offered(wide_src))


@pytest.mark.parametrize("reduce,include_self,joined", [
    ("sum", True, P), ("prod", True, PROD), ("amax", True, MAX), ("amin", True, Partial("min")),
    ("sum", False, None), ("mean", True, None), ("amax", False, None)])
def test_rule_splits_contributions_only_when_exact(reduce: str, include_self: bool, joined: Any) -> None:
    call = call_of(aten.scatter_reduce.two, (Spec, 0, Spec, Spec, reduce, include_self), (6, 5), (4, 5), (4, 5))
    partial = [s for s in offered(call) if s.outputs[0].is_partial()]
    assert partial == ([] if joined is None else [Strategy((joined, Shard(0), Shard(0)), (joined,))])


def test_rule_integer_mean_and_overwriting_put_pass_no_partial() -> None:
    mean = call_of(aten.scatter_reduce.two, (Spec, 0, Spec, Spec, "mean"), (6, 5), (4, 5), (4, 5), dtype=torch.int64)
    mean = OpCall(mean.op, mean.args, {}, tuple(s.with_placements((P,)) for s in mean.ins), mean.outs)
    assert not any(s.outputs[0].is_partial() for s in offered(mean))
    assert offered(call_of(aten.put.default, (Spec, Spec, Spec, False), (6, 5), (4,), (4,))) == []


# -- a real mesh -----------------------------------------------------------------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,fn,inputs,want", CASES[::2], ids=[c[0] for c in CASES[::2]])
def test_real_mesh(procs: Any, name: str, fn: Any, inputs: list, want: tuple) -> None:
    out, comms = placed(procs, fn, *inputs, timeout=150)  # the first program waits for the workers' torch
    assert out.placements == want and comms == [], (out.placements, comms)
