"""Property tests of the named-dim mesh arithmetic (`Extent`, `Shape`, `Point`, `ValueMesh`).

Every view is checked against `Model`, a brute-force nested list of the original mesh's row-major ranks
that is sliced, split and flattened with plain Python list indexing.
"""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import indices, mesh_shapes, raw_slices, row_major, selects, shapes, slice_args

from monarch.errors import MeshError
from monarch.runtime.control.futures import ValueMesh
from monarch.shape import Extent, Shape, group_coords

PROPERTY = settings(max_examples=80, deadline=None)
NEW_NAMES = tuple("abcdefghi")  # disjoint from strategies.DIM_NAMES

Grid = Any  # a global rank (no dims left) or a list of Grids, one list level per dim
View = TypeVar("View", Shape, ValueMesh)


def coords_of(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every coordinate tuple of an extent, in row-major order."""
    return list(itertools.product(*(range(n) for n in sizes)))


def map_at(grid: Grid, depth: int, fn: Callable[[list[Grid]], Grid]) -> Grid:
    """Apply `fn` to every sub-list `depth` levels down."""
    return fn(grid) if depth == 0 else [map_at(g, depth - 1, fn) for g in grid]


def reshape(xs: list[Grid], parts: tuple[int, ...]) -> Grid:
    """Row-major reshape of a flat list into nested lists of sizes `parts`."""
    if len(parts) == 1:
        return xs
    step = len(xs) // parts[0]
    return [reshape(xs[i * step:(i + 1) * step], parts[1:]) for i in range(parts[0])]


@dataclass(frozen=True)
class Model:
    """Brute-force view of a row-major mesh: dim labels and a nested list of global ranks."""
    labels: tuple[str, ...]
    grid: Grid

    @staticmethod
    def of(dims: dict[str, int]) -> Model:
        sizes = tuple(dims.values())
        rank = {c: r for r, c in enumerate(coords_of(sizes))}

        def build(prefix: tuple[int, ...]) -> Grid:
            if len(prefix) == len(sizes):
                return rank[prefix]
            return [build(prefix + (c,)) for c in range(sizes[len(prefix)])]

        return Model(tuple(dims), build(()))

    @property
    def sizes(self) -> tuple[int, ...]:
        out, grid = [], self.grid
        for _ in self.labels:
            out.append(len(grid))
            grid = grid[0]
        return tuple(out)

    def at(self, coords: tuple[int, ...]) -> int:
        grid = self.grid
        for c in coords:
            grid = grid[c]
        return grid

    def ranks(self) -> list[int]:
        return [self.at(c) for c in coords_of(self.sizes)]

    def slice(self, **dims: int | slice) -> Model:
        labels, grid = list(self.labels), self.grid
        for label, sel in dims.items():
            grid = map_at(grid, labels.index(label), lambda xs: xs[sel])
            if isinstance(sel, int):
                labels.remove(label)
        return Model(tuple(labels), grid)

    def split(self, label: str, names: tuple[str, ...], parts: tuple[int, ...]) -> Model:
        i = self.labels.index(label)
        grid = map_at(self.grid, i, lambda xs: reshape(xs, parts))
        return Model(self.labels[:i] + names + self.labels[i + 1:], grid)


def assert_matches(shape: Shape, model: Model) -> None:
    assert (shape.labels, shape.sizes) == (model.labels, model.sizes)
    assert shape.ranks() == model.ranks()
    for coords in coords_of(model.sizes):
        assert shape.rank_at(coords) == model.at(coords), coords


def slice_both(data: st.DataObject, view: View, model: Model, keep_dims: bool = False) -> tuple[View, Model]:
    """Apply the same 0-3 chained random slices to a view and to its model."""
    for _ in range(data.draw(st.integers(0, 3), label="number of slices")):
        args = data.draw(slice_args(view.extent, keep_dims), label="slice")
        view, model = view.slice(**args), model.slice(**args)
    return view, model


def names_dim(label: str, exc: pytest.ExceptionInfo[MeshError]) -> bool:
    return re.search(rf"(?<!\w){re.escape(label)}(?!\w)", str(exc.value)) is not None


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [p for p in itertools.product(divisors, repeat=k) if math.prod(p) == n]


# --- examples with literal expected values ---

def test_slice_keeping_a_dim_cannot_be_flattened() -> None:
    view = Shape.row_major(("dp", "tp"), (2, 4)).slice(tp=slice(0, 2))
    assert (view.labels, view.sizes, view.ranks()) == (("dp", "tp"), (2, 2), [0, 1, 4, 5])
    with pytest.raises(MeshError, match="not evenly spaced"):
        view.flatten("r")


def test_int_drops_the_dim_and_flattens() -> None:
    view = Shape.row_major(("dp", "tp"), (2, 4)).slice(tp=1)
    assert (view.labels, view.ranks()) == (("dp",), [1, 5])
    flat = view.flatten("r")
    assert (flat.labels, flat.sizes, flat.strides, flat.ranks()) == (("r",), (2,), (4,), [1, 5])


def test_negative_index_and_steps() -> None:
    mesh = Shape.row_major(("dp", "tp"), (2, 4))
    assert mesh.slice(dp=-1, tp=slice(1, None, 2)).ranks() == [5, 7]
    reversed_tp = mesh.slice(tp=slice(None, None, -1))
    assert reversed_tp.ranks() == [3, 2, 1, 0, 7, 6, 5, 4]
    with pytest.raises(MeshError, match="not evenly spaced"):
        reversed_tp.flatten("r")
    flat = mesh.slice(dp=slice(None, None, -1), tp=slice(None, None, -1)).flatten("r")
    assert (flat.strides, flat.ranks()) == ((-1,), [7, 6, 5, 4, 3, 2, 1, 0])


def test_split_infers_one_size() -> None:
    view = Shape.row_major(("host", "gpu"), (8, 2)).split(host=("dp", "pp"), pp=2)
    assert (view.labels, view.sizes, view.ranks()) == (("dp", "pp", "gpu"), (4, 2, 2), list(range(16)))
    assert view.point(5) == {"dp": 1, "pp": 0, "gpu": 1}


def test_point_of_row_major_mesh() -> None:
    p = Shape.row_major(("dp", "tp"), (2, 4)).point(6)
    assert (dict(p), p.rank, p.label()) == ({"dp": 1, "tp": 2}, 6, "dp=1,tp=2")


def test_extent_is_the_abstract_mesh() -> None:
    e = Shape.row_major(("dp", "tp"), (2, 3)).slice(tp=slice(0, 2)).extent
    assert e == Extent(("dp", "tp"), (2, 2)) == {"tp": 2, "dp": 2} and hash(e) == hash(Extent(("dp", "tp"), (2, 2)))
    assert e != Extent(("tp", "dp"), (2, 2))  # a mesh's dim order matters: placements follow it
    assert (repr(e), e.label(), e.nelements, len(e), e.dim("tp")) == ("{'dp': 2, 'tp': 2}", "dp=2, tp=2", 4, 2, 1)
    assert list(e.coords()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(MeshError, match="no dim 'pp'"):
        e.dim("pp")


def test_value_mesh_example() -> None:
    vm = ValueMesh(Shape.row_major(("dp", "tp"), (2, 2)), ["a", "b", "c", "d"])
    assert vm.slice(tp=1).values() == ["b", "d"]
    assert vm.item(dp=1, tp=0) == "c"
    assert vm.slice(dp=-1).item(tp=-1) == "d"


@pytest.mark.parametrize("spec, match", [
    ({"host": ("dp", "pp"), "pp": 3}, "does not divide evenly"),
    ({"host": ("dp", "pp"), "dp": 2, "pp": 3}, "does not divide evenly"),
    ({"host": ("dp", "pp", "tp")}, "all but one"),
    ({"host": ("dp", "pp"), "pp": 2, "ep": 2}, r"sizes for \['ep'\]"),
    ({"nope": ("dp", "pp"), "pp": 2}, "'nope'"),
])
def test_split_errors(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(MeshError, match=match):
        Shape.row_major(("host", "gpu"), (4, 2)).split(**spec)


@pytest.mark.parametrize("sel", [True, "0", 1.0, None])
def test_slice_rejects_non_int_selectors(sel: Any) -> None:
    with pytest.raises(MeshError, match="tp="):
        Shape.row_major(("dp", "tp"), (2, 4)).slice(tp=sel)


# --- properties against the brute-force model ---

@PROPERTY
@given(mesh_shapes())
def test_row_major_mesh_matches_model(dims: dict[str, int]) -> None:
    shape = row_major(dims)
    assert_matches(shape, Model.of(dims))
    assert shape.ranks() == list(range(math.prod(dims.values())))
    assert dict(shape.extent) == dims and len(shape) == shape.extent.nelements


@PROPERTY
@given(shapes())
def test_point_and_rank_at_round_trip(shape: Shape) -> None:
    ranks = shape.ranks()
    assert len(ranks) == len(shape)
    for i, coords in enumerate(coords_of(shape.sizes)):
        p = shape.point(i)
        assert p.coords == coords and p.rank == i
        assert dict(p) == dict(zip(shape.labels, coords, strict=True))
        assert shape.rank_at(p.coords) == ranks[i]


@PROPERTY
@given(shapes())
def test_group_coords_are_the_other_dims_sliced_away(shape: Shape) -> None:
    for coords in coords_of(shape.sizes):
        for d, label in enumerate(shape.labels):
            others = {lb: c for lb, c in zip(shape.labels, coords, strict=True) if lb != label}
            group = group_coords(coords, d, shape.sizes)
            assert [shape.rank_at(c) for c in group] == shape.slice(**others).ranks()
            assert group[coords[d]] == coords


@PROPERTY
@given(mesh_shapes(), st.data())
def test_chained_slices_match_model(dims: dict[str, int], data: st.DataObject) -> None:
    shape, model = slice_both(data, row_major(dims), Model.of(dims))
    assert_matches(shape, model)


@settings(PROPERTY, max_examples=150)
@given(mesh_shapes(min_dims=2, min_size=2), st.booleans(), st.data())
def test_flatten_exactly_when_evenly_spaced(dims: dict[str, int], keep_dims: bool, data: st.DataObject) -> None:
    shape, model = slice_both(data, row_major(dims), Model.of(dims), keep_dims)
    ranks = model.ranks()
    if len({b - a for a, b in itertools.pairwise(ranks)}) <= 1:
        flat = shape.flatten("flat")
        assert (flat.labels, flat.ranks()) == (("flat",), ranks)
    else:
        with pytest.raises(MeshError, match="not evenly spaced"):
            shape.flatten("flat")


@PROPERTY
@given(shapes(), st.data())
def test_rename(shape: Shape, data: st.DataObject) -> None:
    old = data.draw(st.permutations(shape.labels), label="old")[:data.draw(st.integers(0, len(shape.labels)))]
    new = data.draw(st.permutations(shape.labels + NEW_NAMES[:3]), label="new")
    names = dict(zip(old, new[:len(old)], strict=True))
    expected = tuple(names.get(label, label) for label in shape.labels)
    if len(set(expected)) < len(expected):
        with pytest.raises(MeshError, match="unique"):
            shape.rename(**names)
        return
    renamed = shape.rename(**names)
    assert renamed.labels == expected
    assert (renamed.sizes, renamed.strides, renamed.offset) == (shape.sizes, shape.strides, shape.offset)


@PROPERTY
@given(mesh_shapes(max_size=8), st.data())
def test_split_matches_model(dims: dict[str, int], data: st.DataObject) -> None:
    shape, model = slice_both(data, row_major(dims), Model.of(dims))
    assume(shape.labels)
    free_names = list(NEW_NAMES)
    spec: dict[str, Any] = {}
    for label in data.draw(st.lists(st.sampled_from(shape.labels), min_size=1, unique=True), label="split"):
        k = data.draw(st.integers(1, 3), label="parts")
        parts = data.draw(st.sampled_from(factorizations(shape.sizes[shape.dim(label)], k)), label="sizes")
        names = tuple(free_names.pop() for _ in parts)
        inferred = data.draw(st.sampled_from((None, *names)), label="inferred")
        spec |= {label: names} | {n: p for n, p in zip(names, parts, strict=True) if n != inferred}
        model = model.split(label, names, parts)
    assert_matches(shape.split(**spec), model)


@PROPERTY
@given(st.integers(1, 12), st.integers(1, 13))
def test_split_divisibility(n: int, pp: int) -> None:
    shape = Shape.row_major(("host",), (n,))
    if n % pp:
        with pytest.raises(MeshError, match="'host'"):
            shape.split(host=("dp", "pp"), pp=pp)
    else:
        assert shape.split(host=("dp", "pp"), pp=pp).sizes == (n // pp, pp)


# --- errors name the dim ---

@PROPERTY
@given(shapes())
def test_unknown_dim_is_named(shape: Shape) -> None:
    for op in (lambda: shape.slice(nope=0), lambda: shape.rename(nope="a"),
               lambda: shape.split(nope=("a", "b")), lambda: shape.dim("nope")):
        with pytest.raises(MeshError) as exc:
            op()
        assert names_dim("nope", exc), exc.value


@PROPERTY
@given(shapes(), st.data())
def test_out_of_range_index_is_named(shape: Shape, data: st.DataObject) -> None:
    assume(shape.labels)
    label = data.draw(st.sampled_from(shape.labels), label="dim")
    n = shape.sizes[shape.dim(label)]
    index = data.draw(st.integers(-n - 10, n + 10).filter(lambda i: not -n <= i < n), label="index")
    with pytest.raises(MeshError) as exc:
        shape.slice(**{label: index})
    assert names_dim(label, exc), exc.value


@PROPERTY
@given(shapes(), st.data())
def test_empty_slice_is_named(shape: Shape, data: st.DataObject) -> None:
    assume(shape.labels)
    label = data.draw(st.sampled_from(shape.labels), label="dim")
    n = shape.sizes[shape.dim(label)]
    sel = data.draw(raw_slices(n).filter(lambda s: selects(s, n) == 0), label="slice")
    with pytest.raises(MeshError) as exc:
        shape.slice(**{label: sel})
    assert names_dim(label, exc), exc.value


# --- ValueMesh ---

@PROPERTY
@given(mesh_shapes(), st.data())
def test_value_mesh_matches_model(dims: dict[str, int], data: st.DataObject) -> None:
    values = [f"v{r}" for r in range(math.prod(dims.values()))]
    vm, model = slice_both(data, ValueMesh(row_major(dims), values), Model.of(dims))
    assert (tuple(vm.extent), tuple(vm.sizes), len(vm)) == (model.labels, model.sizes, math.prod(model.sizes))
    assert vm.values() == [values[r] for r in model.ranks()]
    expected = [(c, values[model.at(c)]) for c in coords_of(model.sizes)]
    assert [(p.coords, v) for p, v in vm.items()] == expected
    for coords, value in expected:
        assert vm.item(**dict(zip(model.labels, coords, strict=True))) == value
        negative = [c - n for c, n in zip(coords, model.sizes, strict=True)]
        assert vm.item(**dict(zip(model.labels, negative, strict=True))) == value


@PROPERTY
@given(mesh_shapes(), st.data())
def test_value_mesh_item_needs_every_dim(dims: dict[str, int], data: st.DataObject) -> None:
    vm = ValueMesh(row_major(dims), list(range(math.prod(dims.values()))))
    missing = data.draw(st.sampled_from(list(dims)), label="missing")
    coords = {label: data.draw(indices(n)) for label, n in dims.items() if label != missing}
    with pytest.raises(MeshError) as exc:
        vm.item(**coords)
    assert names_dim(missing, exc), exc.value
