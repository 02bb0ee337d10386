"""Placements of a tensor over one mesh dim (`Shard(d)`, `Replicate()`, `Partial(op)`) and shard sizes.

A placement tuple has one entry per mesh dim. Shards follow `torch.chunk`: a dim of size n over k
ranks gets pieces of ceil(n/k) elements, the last ones shorter or empty. Several mesh dims sharding
the same tensor dim nest in mesh-dim order (the later dim splits the earlier dim's piece).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from monarch.errors import ShardingError

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")


class Placement:
    """Base of the three placements; instances are frozen and hashable."""
    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The tensor is split along `dim` (torch.chunk pieces, one per rank of the mesh dim)."""
    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True, init=False)
class Partial(Placement):
    """Every rank holds a partial value; the tensor is their reduction by `op` (DTensor's `reduce_op`: sum,
    avg, max, min or prod). `Partial("avg")`, `Partial(reduce_op="avg")` and `Partial(op="avg")` are one."""
    op: str

    def __init__(self, reduce_op: str = "sum", *, op: str | None = None) -> None:
        op = reduce_op if op is None else op
        if op not in REDUCE_OPS:
            raise ShardingError(f"Partial({op!r}) is not a reduction monarch knows; use one of {REDUCE_OPS}")
        object.__setattr__(self, "op", op)

    @property
    def reduce_op(self) -> str:
        return self.op

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.op

    def __repr__(self) -> str:
        return f"P({self.op})"


R = Replicate()
P = Partial("sum")
Placements = tuple[Placement, ...]


def normalize(placements: Mapping[str, Placement] | Sequence[Placement] | None, names: Sequence[str],
              ndim: int, what: str = "placements") -> Placements:
    """A placement per mesh dim from a dict by dim name (missing dims replicate) or a list in dim order."""
    if placements is None:
        out: list[Placement] = [R] * len(names)
    elif isinstance(placements, Mapping):
        unknown = [k for k in placements if k not in names]
        if unknown:
            raise ShardingError(f"{what}: unknown mesh dim(s) {unknown}; the mesh has dims {list(names)}")
        out = [placements.get(n, R) for n in names]
    else:
        out = list(placements)
        if len(out) != len(names):
            raise ShardingError(f"{what}: {len(out)} placements for a mesh with dims {list(names)}; give one per "
                                "dim or a dict by dim name")
    for p in out:
        if not isinstance(p, Placement):
            raise ShardingError(f"{what}: {p!r} is not a placement; use Shard(dim), Replicate() or Partial()")
    return tuple(_wrap(p, ndim, what) for p in out)


def _wrap(p: Placement, ndim: int, what: str) -> Placement:
    if isinstance(p, Shard):
        if not -ndim <= p.dim < max(ndim, 1) or ndim == 0:
            raise ShardingError(f"{what}: {p} is out of range for a tensor with {ndim} dims")
        return Shard(p.dim % ndim)
    return p


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, length) of piece i when n elements are split into k torch.chunk pieces."""
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, max(0, min(size, n - start))


def local_bounds(shape: Sequence[int], placements: Placements, sizes: Sequence[int],
                 coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(start, length) per tensor dim of the shard at mesh `coords`."""
    bounds = [(0, n) for n in shape]
    for p, k, c in zip(placements, sizes, coords, strict=True):
        if isinstance(p, Shard):
            start, n = bounds[p.dim]
            s, m = chunk(n, k, c)
            bounds[p.dim] = (start + s, m)
    return tuple(bounds)


def describe(placements: Placements, names: Sequence[str]) -> str:
    """`{dp: S(0), tp: R}`."""
    return "{" + ", ".join(f"{n}: {p}" for n, p in zip(names, placements, strict=True)) + "}"
