"""Layouts over one mesh dim: the dim a style works on (`MeshDim`), the checks on the layouts a style is
given, and the one way a module's input or output is brought to a layout.

A layout is the placement of a tensor over the style's mesh dim; the other mesh dims keep what the tensor
has. A MeshTensor is redistributed; a plain tensor is the controller's whole value, so it is placed directly
as asked (no collective, where a DTensor would first be assembled from per-rank pieces).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from monarch.errors import MeshError, ShardingError
from monarch.runtime.session.api import distribute_tensor
from monarch.shape import MeshLike
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement, Shard, normalize

Layouts = Union[Placement, Sequence[Union[Placement, None]], None]  # one placement, or one per positional argument
FIX = "use Shard(dim), Replicate() or Partial(): a placement over the style's one mesh dim"


def on_dim(t: Any, dim: str, placement: Placement | None) -> Any:
    """`t` redistributed to `placement` over mesh dim `dim`, the other mesh dims unchanged (differentiable).

    Anything that is not a MeshTensor, and any tensor when `placement` is None, comes back as it is."""
    if placement is None or not isinstance(t, MeshTensor) or (isinstance(placement, Shard) and t.ndim == 0):
        return t
    names = t.spec.mesh.labels
    target = list(t.placements)
    target[names.index(dim)] = placement
    target_t = normalize(target, names, t.ndim, f"redistribute over {dim!r}")
    if target_t == t.placements:
        return t
    return t.redistribute(target_t)


def check_dim(dim: str, names: Sequence[str], what: str) -> None:
    """MeshError unless `dim` names a dim of the mesh."""
    if dim not in names:
        raise MeshError(f"{what}: the mesh has no dim {dim!r} (its dims are {list(names)}); pass dim= one of them")


@dataclass(frozen=True)
class MeshDim:
    """The mesh a style places tensors on and the one dim of it that the style's layouts address."""
    mesh: MeshLike
    dim: str

    def prepare(self, x: Any, layout: Placement | None, desired: Placement | None, what: str) -> Any:
        """`x` (said to be placed as `layout`) brought to `desired`: a MeshTensor is redistributed over the
        dim (its current placement is not checked against `layout`, as in DTensor; without `desired` it is
        left as it is); a plain tensor is placed as `desired`, or as `layout` when no `desired` is given.
        A non-tensor with a layout is an error."""
        if layout is None:
            return x
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"{what} is {type(x).__name__}, not a tensor, but has the layout {layout}; give it "
                                "the layout None")
        if isinstance(x, MeshTensor):
            return on_dim(x, self.dim, desired)
        target = layout if desired is None else desired
        return distribute_tensor(x, self.mesh, {self.dim: target} if x.ndim or not target.is_shard() else {})


# -- checks of the layouts a style is built with -------------------------------------------------
def one_layout(value: Any, what: str) -> Placement | None:
    """A single placement (or None), as ColwiseParallel and RowwiseParallel take."""
    if value is not None and not isinstance(value, Placement):
        raise ShardingError(f"{what}={value!r} is not a placement; {FIX}, or None. A dict by mesh dim has no meaning "
                            "here: the style's mesh dim is the dim of the mesh given to parallelize_module")
    return value


def layout_tuple(value: Layouts, what: str) -> tuple[Placement | None, ...] | None:
    """One placement or a tuple of them (None entries for arguments left alone), as a tuple."""
    if value is None or isinstance(value, Placement):
        return None if value is None else (value,)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ShardingError(f"{what}={value!r} is neither a placement nor a tuple of placements (one per "
                            f"positional argument, None for those left alone); {FIX}")
    return tuple(one_layout(v, f"{what}[{i}]") for i, v in enumerate(value))


def kwarg_layouts(value: Any, what: str) -> dict[str, Placement] | None:
    """A dict keyword name -> placement."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ShardingError(f"{what}={value!r} is not a dict from keyword-argument names to placements")
    for k, v in value.items():
        if not isinstance(v, Placement):
            raise ShardingError(f"{what}[{k!r}]={v!r} is not a placement; {FIX}")
    return dict(value)


def paired(layouts: tuple[Placement | None, ...] | None, desired: tuple[Placement | None, ...] | None,
           names: tuple[str, str], optional_desired: bool) -> None:
    """Layouts and desired layouts agree: both given, as many of each, and a desired layout only where the
    layout says what the tensor is (`optional_desired`: a layout may go without a desired one)."""
    have, want = names
    if layouts is None and desired is None:
        return
    if layouts is None or desired is None:
        missing = have if layouts is None else want
        raise ShardingError(f"{missing} is None while {want if layouts is None else have} is given; "
                            f"{have} and {want} should have same length: give both")
    if len(layouts) != len(desired):
        raise ShardingError(f"{have} and {want} should have same length! ({len(layouts)} != {len(desired)}: "
                            f"{have}={layouts}, {want}={desired}); give one entry per argument, None for "
                            "those left alone")
    for i, (lay, d) in enumerate(zip(layouts, desired, strict=True)):
        if lay is None and d is not None:
            raise ShardingError(f"{want}[{i}] is {d} but {have}[{i}] is None: entry {i} would never be "
                                f"redistributed; give {have}[{i}] (the layout it arrives in) or None in both")
        if lay is not None and d is None and not optional_desired:
            raise ShardingError(f"{have}[{i}] is {lay} but {want}[{i}] is None; give the layout it should "
                                "leave in")


def paired_kwargs(layouts: dict[str, Placement] | None, desired: dict[str, Placement] | None,
                  names: tuple[str, str]) -> None:
    """Keyword layouts and their desired layouts name the same keywords."""
    if layouts is None and desired is None:
        return
    have, want = names
    if (layouts or {}).keys() != (desired or {}).keys():
        raise ShardingError(f"{have} and {want} should have same length and keys! ({sorted(layouts or {})} vs "
                            f"{sorted(desired or {})}); give a desired layout for every keyword with a layout")


def check_flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ShardingError(f"{what}={value!r} is not a bool")
    return value
