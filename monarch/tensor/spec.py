"""What the compiler knows about a mesh tensor: the abstract mesh (dim names and sizes) and the Spec.

A Spec is a global shape, stride and dtype plus one placement per mesh dim; it is all that tracing,
propagation and partitioning see. Local shard shapes are derived from it per mesh coordinate.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

from monarch.tensor.placement import Placement, Placements, Shard, describe, local_bounds


@dataclass(frozen=True)
class AbstractMesh:
    """Named mesh dims and their sizes, without processes."""
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.names)

    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every point in row-major order."""
        return itertools.product(*(range(s) for s in self.sizes))

    def dim(self, name: str) -> int:
        return self.names.index(name)

    def __repr__(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True)) + ")"


@dataclass(frozen=True)
class Spec:
    """A sharded tensor's global meta and its placements over `mesh`."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    placements: Placements
    mesh: AbstractMesh

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.shape, self.stride, self.dtype, self.placements, self.mesh))
        return h

    def with_placements(self, placements: Placements) -> Spec:
        return Spec(self.shape, self.stride, self.dtype, placements, self.mesh)

    def bounds(self, coords: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return local_bounds(self.shape, self.placements, self.mesh.sizes, coords)

    def local_shape(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n for _, n in self.bounds(coords))

    def sharded_dims(self) -> set[int]:
        return {p.dim for p in self.placements if isinstance(p, Shard)}

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def placement_str(self) -> str:
        return describe(self.placements, self.mesh.names)

    def __repr__(self) -> str:
        ps = ", ".join(map(repr, self.placements))
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}[{ps}]"


def spec_of(meta: torch.Tensor, placements: tuple[Placement, ...], mesh: AbstractMesh) -> Spec:
    return Spec(tuple(meta.shape), tuple(meta.stride()), meta.dtype, placements, mesh)
