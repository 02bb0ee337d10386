"""What the compiler knows about a mesh tensor: its Spec over an abstract mesh (`monarch.shape.Extent`).

A Spec is a global shape, stride, dtype and device type plus one placement per mesh dim; it is all that
tracing, propagation and partitioning see. Local shard shapes are derived from it per mesh coordinate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from monarch.shape import Extent
from monarch.tensor.placement import Placement, Placements, describe, local_bounds


@dataclass(frozen=True)
class Spec:
    """A sharded tensor's global meta and its placements over `mesh`."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    placements: Placements
    mesh: Extent
    device: str = "cpu"  # where the workers keep the pieces: cpu, or cuda (each worker's own GPU)

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
            h = self.__dict__["_hash"] = hash((self.shape, self.stride, self.dtype, self.placements, self.mesh,
                                               self.device))
        return h

    def with_placements(self, placements: Placements) -> Spec:
        return Spec(self.shape, self.stride, self.dtype, placements, self.mesh, self.device)

    def bounds(self, coords: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return local_bounds(self.shape, self.placements, self.mesh.sizes, coords)

    def local_shape(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n for _, n in self.bounds(coords))

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def placement_str(self) -> str:
        return describe(self.placements, self.mesh.labels)

    def __repr__(self) -> str:
        ps = ", ".join(map(repr, self.placements))
        on = "" if self.device == "cpu" else f"@{self.device}"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}[{ps}]{on}"


def spec_of(meta: torch.Tensor, placements: tuple[Placement, ...], mesh: Extent, device: str = "cpu") -> Spec:
    return Spec(tuple(meta.shape), tuple(meta.stride()), meta.dtype, placements, mesh, device)
