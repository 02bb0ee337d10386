"""Hypothesis strategies shared by the tests.

Mesh shapes as ordered `{dim: size}` dicts, `Shape` views of them (row-major, optionally sliced), and
`Shape.slice(**dims)` arguments: ints (negative too) and slices (negative steps too) that select something.
For sharded tensors: small tensor meshes, tensor shapes (uneven over the mesh), placements, and random
tensor programs (op sequences drawn from a table of torch ops, valid by construction).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from monarch.runtime.session.local import LocalMesh
from monarch.shape import Shape
from monarch.tensor import Partial, Placement, Replicate, Shard

DIM_NAMES = ("dp", "tp", "pp", "ep", "cp", "sp", "x", "y", "z")

Selector = int | slice


@st.composite
def mesh_shapes(draw: st.DrawFn, min_dims: int = 1, max_dims: int = 3, min_size: int = 1,
                max_size: int = 4) -> dict[str, int]:
    """Ordered `{dim: size}` dicts with unique short dim names."""
    labels = draw(st.lists(st.sampled_from(DIM_NAMES), min_size=min_dims, max_size=max_dims, unique=True))
    return {label: draw(st.integers(min_size, max_size)) for label in labels}


def row_major(dims: dict[str, int]) -> Shape:
    return Shape.row_major(tuple(dims), tuple(dims.values()))


@st.composite
def shapes(draw: st.DrawFn, max_size: int = 4) -> Shape:
    """A row-major mesh, half of the time seen through a random slice."""
    shape = row_major(draw(mesh_shapes(max_size=max_size)))
    if draw(st.booleans()):
        shape = shape.slice(**draw(slice_args(shape.extent)))
    return shape


def indices(size: int) -> st.SearchStrategy[int]:
    """Valid indices into a dim of `size`, negative ones included."""
    return st.integers(-size, size - 1)


def raw_slices(size: int) -> st.SearchStrategy[slice]:
    """Any slice over a dim of `size`: bounds may be negative, None or out of range; steps may be negative."""
    bound = st.none() | st.integers(-size - 2, size + 2)
    step = st.none() | st.integers(-3, 3).filter(bool)
    return st.builds(slice, bound, bound, step)


def selects(sel: slice, size: int) -> int:
    """How many indices `sel` selects from a dim of `size`."""
    return len(range(*sel.indices(size)))


def nonempty_slices(size: int) -> st.SearchStrategy[slice]:
    return raw_slices(size).filter(lambda sel: selects(sel, size) > 0)


def selectors(size: int, keep_dims: bool = False) -> st.SearchStrategy[Selector]:
    """An index (drops the dim) or a non-empty slice (keeps it); only slices if `keep_dims`."""
    return nonempty_slices(size) if keep_dims else indices(size) | nonempty_slices(size)


@st.composite
def slice_args(draw: st.DrawFn, extent: Mapping[str, int], keep_dims: bool = False) -> dict[str, Selector]:
    """Arguments for `view.slice(**args)` given `view.extent`: some of its dims, in any order, each selected."""
    order = draw(st.permutations(list(extent)))
    picks = {label: draw(st.none() | selectors(extent[label], keep_dims)) for label in order}
    return {label: sel for label, sel in picks.items() if sel is not None}


# -- sharded tensors --------------------------------------------------------------------------------

TENSOR_MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2}, {"x": 3})
_REFERENCE: dict[tuple[tuple[str, int], ...], LocalMesh] = {}


def reference_mesh(dims: dict[str, int]) -> LocalMesh:
    """The in-process reference mesh with these dims, one per process (its session lives across examples)."""
    key = tuple(dims.items())
    if key not in _REFERENCE:
        _REFERENCE[key] = LocalMesh(dims)
    return _REFERENCE[key]


def tensor_meshes(meshes: tuple[dict[str, int], ...] = TENSOR_MESHES) -> st.SearchStrategy[dict[str, int]]:
    """`{dim: size}` of the small meshes sharded-tensor tests run on (sizes 1-4, one or two dims)."""
    return st.sampled_from(meshes)


def tensor_shapes(min_dims: int = 1, max_dims: int = 3, min_size: int = 1,
                  max_size: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """Global tensor shapes; sizes 1-7 over meshes of 2-4 give uneven and empty torch.chunk pieces."""
    return st.lists(st.integers(min_size, max_size), min_size=min_dims, max_size=max_dims).map(tuple)


def placements_for(ndim: int, partial: bool = True) -> st.SearchStrategy[Placement]:
    """One mesh dim's placement of a tensor with `ndim` dims: R, S(d) or (if `partial`) P(sum)."""
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(ndim))]
    if partial:
        options.append(Partial("sum"))
    return st.sampled_from(options)


def placement_tuples(ndim: int, mesh_ndim: int, partial: bool = True) -> st.SearchStrategy[tuple[Placement, ...]]:
    """A placement per mesh dim (nested shards of one tensor dim included)."""
    return st.tuples(*(placements_for(ndim, partial) for _ in range(mesh_ndim)))


# -- random tensor programs ---------------------------------------------------------------------------
# A program is a list of steps over a growing pool of values; step i's result is value i. A "leaf" step
# brings in new data (a distributed tensor), "redistribute" changes placements, every other step is an
# entry of OPS applied to earlier values. `programs()` builds them while running each step on meta
# tensors, so every drawn program is valid plain-torch code.

@dataclass(frozen=True)
class Step:
    op: str
    ins: tuple[int, ...]
    params: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return f"{self.op}({', '.join([*(f'v{i}' for i in self.ins), *map(repr, self.params)])})"


@dataclass(frozen=True)
class Program:
    steps: tuple[Step, ...]

    def outputs(self) -> list[int]:
        """Values no later step reads (leaves excluded): fetching these checks every computed value."""
        read = {i for s in self.steps for i in s.ins}
        return [i for i, s in enumerate(self.steps) if i not in read and s.op != "leaf"]

    def __repr__(self) -> str:
        return "; ".join(f"v{i} = {s!r}" for i, s in enumerate(self.steps))


def leaf_data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run_program(program: Program, leaf: Callable[[torch.Tensor, tuple], Any],
                redistribute: Callable[[Any, tuple], Any]) -> list[Any]:
    """Every value of `program`; `leaf(data, placements)` makes an input, `redistribute(x, placements)`."""
    env: list[Any] = []
    for s in program.steps:
        args = [env[i] for i in s.ins]
        if s.op == "leaf":
            shape, dtype, seed, placements = s.params
            env.append(leaf(leaf_data(shape, dtype, seed), placements))
        elif s.op == "redistribute":
            env.append(redistribute(args[0], s.params[0]))
        else:
            env.append(OPS[s.op](*args, *s.params))
    return env


OPS: dict[str, Callable[..., Any]] = {
    "abs": torch.abs, "neg": torch.neg, "relu": torch.relu, "sigmoid": torch.sigmoid, "sin": torch.sin,
    "tanh": torch.tanh, "exp": lambda x: x.clamp(-4, 4).exp(), "square": lambda x: x ** 2,
    "add_scalar": lambda x, c: x + c, "mul_scalar": lambda x, c: x * c, "rsub_scalar": lambda x, c: c - x,
    "div_scalar": lambda x, c: x / c, "add": torch.add, "sub": torch.sub, "mul": torch.mul,
    "maximum": torch.maximum, "div": lambda a, b: a / (b.abs() + 1),
    "gt": lambda a, b: a > b, "lt_scalar": lambda x, c: x < c,
    "where": torch.where, "where_scalar": lambda c, x, s: torch.where(c, x, s),
    "float": lambda x: x.float(), "double": lambda x: x.double(),
    "mm": torch.mm, "matmul": torch.matmul, "linear": torch.nn.functional.linear,
    "sum": lambda x, dims, keep: x.sum(dims, keepdim=keep), "sum_all": lambda x: x.sum(),
    "mean": lambda x, dims, keep: x.mean(dims, keepdim=keep), "amax": lambda x, dims, keep: x.amax(dims, keep),
    "softmax": lambda x, d: torch.softmax(x, d), "log_softmax": lambda x, d: torch.log_softmax(x, d),
    "transpose": lambda x, i, j: x.transpose(i, j), "permute": lambda x, perm: x.permute(perm),
    "t": lambda x: x.t(), "view": lambda x, shape: x.view(shape), "reshape": lambda x, shape: x.reshape(shape),
    "cat": lambda a, b, d: torch.cat([a, b], d),
}
UNARY_OPS = ("abs", "neg", "relu", "sigmoid", "sin", "tanh", "exp", "square", "float", "double")
SCALAR_OPS = ("add_scalar", "mul_scalar", "rsub_scalar", "div_scalar")
BINARY_OPS = ("add", "sub", "mul", "maximum", "div", "gt")
REDUCE_OPS = ("sum", "mean", "amax")


class _Builder:
    """Program under construction: steps and the meta tensor of every value so far."""

    def __init__(self, draw: st.DrawFn, mesh_ndim: int) -> None:
        self.draw: Callable[[st.SearchStrategy[Any]], Any] = draw
        self.mesh_ndim = mesh_ndim
        self.steps: list[Step] = []
        self.metas: list[torch.Tensor] = []

    def add(self, op: str, ins: tuple[int, ...], *params: Any) -> int:
        if op == "leaf":
            meta = torch.empty(params[0], dtype=params[1], device="meta")
        elif op == "redistribute":
            meta = self.metas[ins[0]]
        else:
            meta = OPS[op](*(self.metas[i] for i in ins), *params)
        self.steps.append(Step(op, ins, params))
        self.metas.append(meta)
        return len(self.metas) - 1

    def leaf(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        placements = self.draw(placement_tuples(len(shape), self.mesh_ndim, partial=dtype.is_floating_point))
        return self.add("leaf", (), tuple(shape), dtype, self.draw(st.integers(0, 2**16)), placements)

    def pick(self, ok: Callable[[torch.Tensor], bool]) -> int | None:
        """An earlier value (not only the newest) that satisfies `ok`, or None."""
        found = [i for i, m in enumerate(self.metas) if ok(m)]
        return self.draw(st.sampled_from(found)) if found else None

    def partner(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """An earlier value that broadcasts against `shape`, or a new leaf with a broadcastable shape."""
        found = [i for i, m in enumerate(self.metas) if m.dtype == dtype and _broadcasts(tuple(m.shape), shape)]
        if found and self.draw(st.booleans()):
            return self.draw(st.sampled_from(found))
        keep = self.draw(st.integers(0, len(shape)))
        dims = [n if self.draw(st.booleans()) else 1 for n in shape[len(shape) - keep:]]
        return self.leaf(tuple(dims), dtype)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def _floating(m: torch.Tensor) -> bool:
    return m.dtype.is_floating_point


def _gen_unary(b: _Builder) -> None:
    op = b.draw(st.sampled_from(UNARY_OPS))
    x = b.pick(lambda m: m.dtype == torch.bool if op == "float" else _floating(m))
    if x is None:
        return
    b.add(op, (x,))


def _gen_scalar(b: _Builder) -> None:
    x = b.pick(_floating)
    if x is None:
        return
    b.add(b.draw(st.sampled_from(SCALAR_OPS)), (x,), b.draw(st.sampled_from([2, -1.5, 0.5, 3.0])))


def _gen_binary(b: _Builder) -> None:
    x = b.pick(_floating)
    if x is None:
        return
    m = b.metas[x]
    y = b.partner(tuple(m.shape), m.dtype)
    ins = (x, y) if b.draw(st.booleans()) else (y, x)
    b.add(b.draw(st.sampled_from(BINARY_OPS)), ins)


def _gen_where(b: _Builder) -> None:
    c = b.pick(lambda m: m.dtype == torch.bool)
    if c is None:
        x = b.pick(_floating)
        if x is None:
            return
        c = b.add("lt_scalar", (x,), b.draw(st.sampled_from([0.0, 0.5])))
    shape = tuple(b.metas[c].shape)
    x = b.partner(shape, torch.float32)
    if b.draw(st.booleans()):
        b.add("where_scalar", (c, x), b.draw(st.sampled_from([0.0, -1.0])))
    else:
        both = tuple(torch.broadcast_shapes(shape, b.metas[x].shape))
        b.add("where", (c, x, b.partner(both, torch.float32)))


def _gen_matmul(b: _Builder) -> None:
    x = b.pick(lambda m: _floating(m) and m.ndim >= 1)
    if x is None:
        return
    m = b.metas[x]
    k, n = m.shape[-1], b.draw(st.integers(1, 6))
    op = b.draw(st.sampled_from(["mm", "matmul", "linear"] if m.ndim == 2 else ["matmul", "linear"]))
    if op == "linear":
        ins = (x, b.leaf((n, k), m.dtype), *([b.leaf((n,), m.dtype)] if b.draw(st.booleans()) else []))
    else:
        rhs = b.draw(st.sampled_from([(k,), (k, n)] + ([(m.shape[0], k, n)] if m.ndim == 3 else [])))
        ins = (x, b.leaf(rhs if op == "matmul" else (k, n), m.dtype))
    b.add(op, ins)


def _gen_reduce(b: _Builder) -> None:
    x = b.pick(_floating)
    if x is None:
        return
    ndim = b.metas[x].ndim
    if ndim == 0 or b.draw(st.integers(0, 4)) == 0:
        b.add("sum_all", (x,))
        return
    dims = b.draw(st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=ndim, unique_by=lambda d: d % ndim))
    b.add(b.draw(st.sampled_from(REDUCE_OPS)), (x,), dims, b.draw(st.booleans()))


def _gen_softmax(b: _Builder) -> None:
    x = b.pick(lambda m: _floating(m) and m.ndim >= 1)
    if x is None:
        return
    b.add(b.draw(st.sampled_from(["softmax", "log_softmax"])), (x,), b.draw(st.integers(0, b.metas[x].ndim - 1)))


def _gen_layout(b: _Builder) -> None:
    x = b.pick(lambda m: m.ndim >= 2)
    if x is None:
        return
    ndim = b.metas[x].ndim
    op = b.draw(st.sampled_from(["transpose", "permute"] + (["t"] if ndim == 2 else [])))
    if op == "transpose":
        b.add(op, (x,), b.draw(st.integers(0, ndim - 1)), b.draw(st.integers(-ndim, ndim - 1)))
    elif op == "permute":
        b.add(op, (x,), tuple(b.draw(st.permutations(range(ndim)))))
    else:
        b.add(op, (x,))


def _gen_reshape(b: _Builder) -> None:
    x = b.pick(lambda m: m.ndim >= 1)
    if x is None:
        return
    shape = list(b.metas[x].shape)
    i = b.draw(st.integers(0, len(shape) - 1))
    how = b.draw(st.sampled_from(["flatten", "merge", "split", "unsqueeze"]))
    if how == "flatten":
        new = [-1]
    elif how == "merge" and i + 1 < len(shape):
        new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
    elif how == "split" and shape[i] > 1:
        f = b.draw(st.sampled_from([f for f in range(1, shape[i] + 1) if shape[i] % f == 0]))
        new = shape[:i] + [f, shape[i] // f] + shape[i + 1:]
    else:
        new = shape[:i] + [1] + shape[i:]
    try:
        b.metas[x].view(new)
        op = b.draw(st.sampled_from(["view", "reshape"]))
    except RuntimeError:
        op = "reshape"
    b.add(op, (x,), tuple(new))


def _gen_cat(b: _Builder) -> None:
    x = b.pick(lambda m: m.ndim >= 1)
    if x is None:
        return
    m = b.metas[x]
    d = b.draw(st.integers(0, m.ndim - 1))
    same = [i for i, o in enumerate(b.metas) if o.dtype == m.dtype and o.ndim == m.ndim
            and all(p == q for j, (p, q) in enumerate(zip(o.shape, m.shape, strict=True)) if j != d)]
    shape = list(m.shape)
    shape[d] = b.draw(st.integers(1, 4))
    y = b.draw(st.sampled_from(same)) if b.draw(st.booleans()) else b.leaf(tuple(shape), m.dtype)
    b.add("cat", (x, y), d)


def _gen_redistribute(b: _Builder) -> None:
    x = b.draw(st.integers(0, len(b.metas) - 1))
    m = b.metas[x]
    b.add("redistribute", (x,), b.draw(placement_tuples(m.ndim, b.mesh_ndim, partial=_floating(m))))


GENERATORS: tuple[Callable[[_Builder], None], ...] = (
    _gen_unary, _gen_scalar, _gen_binary, _gen_where, _gen_matmul, _gen_reduce, _gen_softmax,
    _gen_layout, _gen_reshape, _gen_cat, _gen_redistribute,
)


@st.composite
def programs(draw: st.DrawFn, mesh_ndim: int, max_ops: int = 6) -> Program:
    """A random valid program: a first input of a random (often uneven) shape, then 1..max_ops ops."""
    b = _Builder(draw, mesh_ndim)
    b.leaf(draw(tensor_shapes(max_dims=3, max_size=6)))
    n = draw(st.integers(1, max_ops))
    while sum(s.op != "leaf" for s in b.steps) < n:
        draw(st.sampled_from(GENERATORS))(b)
    return Program(tuple(b.steps))
