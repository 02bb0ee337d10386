"""Named-dim mesh shapes: the rank <-> coordinates arithmetic behind every mesh.

An `Extent` (dim names and sizes) is the abstract mesh that tracing, propagation and partitioning see. A
`Shape` is a strided view (offset, sizes, strides) over a linear rank space with a label per dim, as
Monarch's ndslice. Slicing, flattening, renaming and splitting are pure arithmetic on it; `MeshView`
gives ProcMesh, ActorMesh and ValueMesh the same named-dim methods; `DeviceMeshNames` gives ProcMesh and
LocalMesh DeviceMesh's (with `SubMesh`, `mesh["tp"]`, and the default mesh of `with mesh:`); `MeshLike` is
what the tensor API needs of a mesh. No I/O, no dependencies.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from monarch.errors import MeshError


@dataclass(frozen=True, eq=False)
class Extent(Mapping[str, int]):
    """Dim names and sizes, in order: the abstract mesh. A read-only mapping label -> size, equal to the
    same dict; two extents are equal only with their dims in the same order."""
    labels: tuple[str, ...]
    sizes: tuple[int, ...]

    def __hash__(self) -> int:
        return hash((self.labels, self.sizes))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return self.labels == other.labels and self.sizes == other.sizes
        return Mapping.__eq__(self, other)

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nelements(self) -> int:
        return math.prod(self.sizes)

    def dim(self, label: str) -> int:
        """Index of a dim by name, or a MeshError naming the dims that exist."""
        try:
            return self.labels.index(label)
        except ValueError:
            raise MeshError(f"mesh has no dim {label!r}; its dims are {self.labels}") from None

    def size(self, dim: int | str | None = None) -> int:
        """Points in the mesh (dim None), or the size of one dim, by name or position (DeviceMesh.size's int)."""
        if dim is None:
            return self.nelements
        if isinstance(dim, str):
            return self.sizes[self.dim(dim)]
        if not -len(self.sizes) <= dim < len(self.sizes):
            raise MeshError(f"mesh dim {dim} is out of range for a mesh with dims {self.labels}")
        return self.sizes[dim]

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every point's coordinates, in row-major order."""
        return itertools.product(*(range(n) for n in self.sizes))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"'{k}': {v}" for k, v in zip(self.labels, self.sizes, strict=True)) + "}"

    def label(self) -> str:
        """`dp=2, tp=2`: how a MeshTensor and `explain` name their mesh."""
        return ", ".join(f"{k}={v}" for k, v in zip(self.labels, self.sizes, strict=True))


@dataclass(frozen=True, eq=False)
class Point(Mapping[str, int]):
    """One position in an extent: a mapping dim -> index, with `.rank` its row-major index."""
    coords: tuple[int, ...]
    extent: Extent

    def __hash__(self) -> int:
        return hash((self.coords, self.extent))

    def __getitem__(self, label: str) -> int:
        try:
            return self.coords[self.extent.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.extent.labels)

    def __len__(self) -> int:
        return len(self.coords)

    @property
    def rank(self) -> int:
        r = 0
        for c, n in zip(self.coords, self.extent.sizes, strict=True):
            r = r * n + c
        return r

    def __repr__(self) -> str:
        return "{" + ", ".join(f"'{k}': {v}" for k, v in zip(self.extent.labels, self.coords, strict=True)) + "}"

    def label(self) -> str:
        """`dp=1,tp=0`: how logs and errors name this point."""
        return ",".join(f"{k}={v}" for k, v in zip(self.extent.labels, self.coords, strict=True))


def group_coords(coords: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The points a collective over mesh dim `dim` runs among, seen from `coords`, in group order: `coords`
    with entry `dim` taking every value. `Shape.rank_at` turns them into the group's world ranks."""
    return [coords[:dim] + (k,) + coords[dim + 1:] for k in range(sizes[dim])]


@dataclass(frozen=True)
class Shape:
    """A labelled strided view of ranks: rank(coords) = offset + sum(coords[i] * strides[i])."""
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def __post_init__(self) -> None:
        assert len(self.labels) == len(self.sizes) == len(self.strides), (self.labels, self.sizes, self.strides)
        if len(set(self.labels)) != len(self.labels):
            raise MeshError(f"mesh dim names must be unique, got {self.labels}")
        if any(n < 1 for n in self.sizes):
            raise MeshError(f"mesh dims must have size >= 1, got {dict(zip(self.labels, self.sizes, strict=True))}")

    @staticmethod
    def row_major(labels: tuple[str, ...], sizes: tuple[int, ...], offset: int = 0) -> Shape:
        strides, acc = [], 1
        for n in reversed(sizes):
            strides.append(acc)
            acc *= n
        return Shape(tuple(labels), tuple(sizes), tuple(reversed(strides)), offset)

    @property
    def extent(self) -> Extent:
        return Extent(self.labels, self.sizes)

    def __len__(self) -> int:
        return math.prod(self.sizes)

    def dim(self, label: str) -> int:
        return self.extent.dim(label)

    def point(self, index: int) -> Point:
        """The point at row-major position `index` of this view."""
        coords = []
        for n in reversed(self.sizes):
            index, c = divmod(index, n)
            coords.append(c)
        return Point(tuple(reversed(coords)), self.extent)

    def rank_at(self, coords: tuple[int, ...]) -> int:
        return self.offset + sum(c * s for c, s in zip(coords, self.strides, strict=True))

    def ranks(self) -> list[int]:
        """Global ranks of this view in row-major order."""
        out = [self.offset]
        for n, s in zip(self.sizes, self.strides, strict=True):
            out = [r + i * s for r in out for i in range(n)]
        return out

    def slice(self, **dims: int | slice) -> Shape:
        """An int drops the dim (selects one index); a `slice` keeps it."""
        labels, sizes, strides, offset = list(self.labels), list(self.sizes), list(self.strides), self.offset
        for label, sel in dims.items():
            i = labels.index(label) if label in labels else self.dim(label)
            if isinstance(sel, slice):
                r = range(*sel.indices(sizes[i]))
                if len(r) == 0:
                    raise MeshError(f"slice {label}={sel} of size {sizes[i]} selects nothing")
                offset += r.start * strides[i]
                sizes[i], strides[i] = len(r), strides[i] * r.step
            elif isinstance(sel, int) and not isinstance(sel, bool):
                if not -sizes[i] <= sel < sizes[i]:
                    raise MeshError(f"index {label}={sel} is out of range for size {sizes[i]}")
                offset += (sel % sizes[i]) * strides[i]
                del labels[i], sizes[i], strides[i]
            else:
                raise MeshError(f"slice {label}= takes an int or a slice, got {sel!r}")
        return Shape(tuple(labels), tuple(sizes), tuple(strides), offset)

    def flatten(self, name: str) -> Shape:
        """Merge all dims into one named `name`; needs the view to be evenly strided."""
        kept = [(n, s) for n, s in zip(self.sizes, self.strides, strict=True) if n > 1]
        for (_, s0), (n1, s1) in zip(kept, kept[1:]):
            if s0 != s1 * n1:
                raise MeshError(f"cannot flatten {self.extent} (strides {self.strides}): the ranks are not "
                                "evenly spaced; flatten the parent mesh first, then slice")
        stride = kept[-1][1] if kept else 1
        return Shape((name,), (len(self),), (stride,), self.offset)

    def rename(self, **names: str) -> Shape:
        for old in names:
            self.dim(old)
        return Shape(tuple(names.get(lb, lb) for lb in self.labels), self.sizes, self.strides, self.offset)

    def split(self, **spec: Any) -> Shape:
        """`split(host=("dp", "pp"), pp=2)`: replace dim `host` by dims dp, pp (one size may be inferred)."""
        groups = {k: tuple(v) for k, v in spec.items() if isinstance(v, (tuple, list))}
        sizes_given = {k: v for k, v in spec.items() if k not in groups}
        new_names = {n for names in groups.values() for n in names}
        if unknown := set(sizes_given) - new_names:
            raise MeshError(f"split got sizes for {sorted(unknown)}, which no split dim produces")
        labels, sizes, strides = [], [], []
        for label, n, s in zip(self.labels, self.sizes, self.strides, strict=True):
            if label not in groups:
                labels.append(label)
                sizes.append(n)
                strides.append(s)
                continue
            parts = _split_sizes(label, n, groups[label], sizes_given)
            acc = s
            part_strides = []
            for p in reversed(parts):
                part_strides.append(acc)
                acc *= p
            labels += groups[label]
            sizes += parts
            strides += reversed(part_strides)
        for k in groups:
            self.dim(k)
        return Shape(tuple(labels), tuple(sizes), tuple(strides), self.offset)


def _split_sizes(label: str, n: int, names: tuple[str, ...], given: dict[str, Any]) -> list[int]:
    missing = [x for x in names if x not in given]
    known = math.prod(int(given[x]) for x in names if x in given)
    if len(missing) > 1:
        raise MeshError(f"split of {label!r} into {names}: give the sizes of all but one of {missing}")
    if (missing and (known == 0 or n % known)) or (not missing and known != n):
        raise MeshError(f"split of {label!r} (size {n}) into {names} with sizes "
                        f"{ {x: given[x] for x in names if x in given} } does not divide evenly")
    return [int(given[x]) if x in given else n // known for x in names]


V = TypeVar("V", bound="MeshView")


class MeshView:
    """Named-dim methods shared by every mesh; subclasses define `_shape` and `_with_shape`."""
    _shape: Shape

    def _with_shape(self: V, shape: Shape) -> V:
        raise AssertionError(f"{type(self).__name__} must define _with_shape")

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    @property
    def mesh_shape(self) -> Shape:
        """The ranks of this view, with a label per dim."""
        return self._shape

    @property
    def sizes(self) -> list[int]:
        return list(self._shape.sizes)

    def size(self, dim: int | str | None = None) -> int:
        return self._shape.extent.size(dim)

    def __len__(self) -> int:
        return len(self._shape)

    def slice(self: V, **dims: int | slice) -> V:
        return self._with_shape(self._shape.slice(**dims))

    def flatten(self: V, name: str) -> V:
        return self._with_shape(self._shape.flatten(name))

    def rename(self: V, **names: str) -> V:
        return self._with_shape(self._shape.rename(**names))

    def split(self: V, **spec: Any) -> V:
        return self._with_shape(self._shape.split(**spec))


P = TypeVar("P")  # a placement: shape.py knows no tensor types
D = TypeVar("D", bound="DeviceMeshNames")


class DeviceMeshNames:
    """DeviceMesh's names (torch.distributed.device_mesh) in their single-controller meaning, on ProcMesh and
    LocalMesh: names and sizes answer as DeviceMesh's do, `mesh["tp"]` is a SubMesh, and `with mesh:` makes
    the mesh monarch.dtensor's default mesh inside the block. What a rank asks of itself has no answer on the
    controller, which is none of the mesh's ranks: those calls raise a MeshError naming what replaces them."""
    extent: Extent
    device: str
    __iter__ = None  # mesh[...] takes dim names: a mesh is not a sequence of ranks

    @property
    def ndim(self) -> int:
        return len(self.extent)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.extent.labels

    @property
    def shape(self) -> tuple[int, ...]:
        """The size of each dim, in order (DeviceMesh.shape)."""
        return self.extent.sizes

    @property
    def device_type(self) -> str:
        return self.device

    def size(self, mesh_dim: int | str | None = None) -> int:
        return self.extent.size(mesh_dim)

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMeshNames:
        """`mesh["tp"]`, `mesh["dp", "tp"]`: the same processes, addressed by these dims only (a SubMesh)."""
        names = (dims,) if isinstance(dims, str) else dims
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise MeshError(f"mesh[{dims!r}]: index a mesh by dim names, as mesh['tp'] or mesh['dp', 'tp']; "
                            f"its dims are {self.mesh_dim_names}")
        if missing := [n for n in names if n not in self.mesh_dim_names]:
            raise MeshError(f"mesh{list(names)}: no dim {missing[0]!r}; the mesh's dims are {self.mesh_dim_names}")
        if names == self.mesh_dim_names:
            return self
        return SubMesh(self.root if isinstance(self, SubMesh) else self, names)

    def get_coordinate(self) -> tuple[int, ...]:
        raise self._per_rank("get_coordinate()")

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        raise self._per_rank("get_local_rank()")

    def get_rank(self) -> int:
        raise self._per_rank("get_rank()")

    def get_group(self, mesh_dim: int | str | None = None) -> object:
        raise MeshError(f"{type(self).__name__}.get_group(): a single controller has no process groups: "
                        "collectives happen by redistributing, t.redistribute(placements) (all_gather, all_reduce, "
                        "reduce_scatter, all_to_all as the placements need) or t.full_tensor(); for per-rank "
                        "code use monarch.local_map")

    def _per_rank(self, what: str) -> MeshError:
        return MeshError(f"{type(self).__name__}.{what} has no meaning on a single controller: this process drives "
                         f"the mesh's {self.size()} ranks and is none of them. For per-rank code use "
                         "monarch.local_map(fn, in_placements, out_placements), which runs fn on each rank's "
                         "pieces; inside an actor endpoint, monarch.actor.current_rank() is the actor's point; "
                         "collectives happen by t.redistribute(placements)")

    def __enter__(self: D) -> D:
        _stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                return


@dataclass(frozen=True)
class SubMesh(DeviceMeshNames):
    """`mesh["tp"]`: the processes of `root`, addressed by `dims` only. A tensor placed on it lives on the whole
    mesh: positional placements name `dims` in order, and every other dim of `root` is Replicate."""
    root: MeshLike
    dims: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.dims or len(set(self.dims)) != len(self.dims):
            raise MeshError(f"a submesh names each dim of {self.root.extent.labels} at most once, got {self.dims}")

    @property
    def extent(self) -> Extent:  # type: ignore[override]
        return Extent(self.dims, tuple(self.root.extent[d] for d in self.dims))

    @property
    def device(self) -> str:  # type: ignore[override]
        return self.root.device

    def placements(self, given: Mapping[str, P] | Sequence[P] | None) -> dict[str, P]:
        """Placements for this view's dims (one per dim in order, or by name) by dim name of `root`; the dims
        outside the view are not named (they replicate)."""
        if given is None:
            return {}
        if isinstance(given, Mapping):
            if outside := [k for k in given if k not in self.dims]:
                raise MeshError(f"placements name {outside}, which {self!r} does not address; its dims are {self.dims}")
            return dict(given)
        given = list(given)
        if len(given) != len(self.dims):
            raise MeshError(f"{len(given)} placements for {self!r}, which has dims {self.dims}: give one per dim")
        return dict(zip(self.dims, given, strict=True))

    def __repr__(self) -> str:
        return f"{self.root!r}[{', '.join(repr(d) for d in self.dims)}]"


class _Defaults(threading.local):
    def __init__(self) -> None:
        self.stack: list[DeviceMeshNames] = []


_DEFAULTS = _Defaults()


def _stack() -> list[DeviceMeshNames]:
    return _DEFAULTS.stack


def default_mesh() -> DeviceMeshNames | None:
    """The mesh of the innermost `with mesh:` block on this thread (DeviceMesh's current mesh), or None."""
    stack = _stack()
    return stack[-1] if stack else None


class MeshLike(Protocol):
    """A mesh MeshTensors live on (a ProcMesh view, a LocalMesh): named dims over ranks, as MeshView has, and
    the device type of its workers' tensors (cpu or cuda)."""

    @property
    def device(self) -> str: ...

    @property
    def extent(self) -> Extent: ...

    @property
    def mesh_shape(self) -> Shape: ...

    def size(self, dim: int | str | None = None) -> int: ...
