"""Hypothesis strategies shared by the tests.

Mesh shapes as ordered `{dim: size}` dicts, `Shape` views of them (row-major, optionally sliced), and
`Shape.slice(**dims)` arguments: ints (negative too) and slices (negative steps too) that select something.
"""
from __future__ import annotations

from collections.abc import Mapping

from hypothesis import strategies as st

from monarch.runtime.shape import Shape

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
