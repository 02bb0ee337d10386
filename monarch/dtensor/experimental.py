"""DTensor's experimental `local_map` (torch.distributed.tensor.experimental's signature) over monarch.local_map.

Input placements are checked (or, with redistribute_inputs=True, reached by redistributing), None stands
for a non-tensor argument or result, and `in_grad_placements` places the inputs' gradients. Results that
are not tensors come from running `func` on meta tensors of rank 0's pieces: they may depend on shapes only.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from monarch.errors import ShardingError
from monarch.runtime.session.local_map import mapped
from monarch.shape import DeviceMeshNames, SubMesh
from monarch.tensor.meshtensor import MeshTensor, PlacementsLike, backend_of
from monarch.tensor.placement import Placement, Replicate, normalize

__all__ = ["local_map"]


def local_map(func: Callable[..., Any] | None = None, out_placements: Any = None,
              in_placements: Sequence[PlacementsLike] | None = None,
              in_grad_placements: Sequence[PlacementsLike] | None = None,
              device_mesh: DeviceMeshNames | None = None, *, redistribute_inputs: bool = False) -> Any:
    """`func` run on each rank's local pieces of its MeshTensor arguments, its tensor results forming
    MeshTensors placed as `out_placements` (a placement list, or a tuple of them, one per result); called
    without MeshTensors it is `func` itself. Without func, a decorator."""
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    return functools.wraps(func)(_LocalMapped(func, out_placements, in_placements, in_grad_placements,
                                              device_mesh, redistribute_inputs))


@dataclass(frozen=True)
class _Picked:
    """What the workers run: func, keeping the results at `keep` (its tensors), with its keyword arguments."""
    func: Callable[..., Any]
    keep: tuple[int, ...] | None  # None: func's result as it is
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __call__(self, *args: Any) -> Any:
        out = self.func(*args, **dict(self.kwargs))
        return out if self.keep is None else tuple(out[k] for k in self.keep)


@dataclass
class _LocalMapped:
    func: Callable[..., Any]
    out_placements: Any
    in_placements: Sequence[PlacementsLike] | None
    in_grad_placements: Sequence[PlacementsLike] | None
    device_mesh: DeviceMeshNames | None
    redistribute_inputs: bool
    _mapped: dict[tuple[int, tuple[int, ...] | None], Callable[..., Any]] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, MeshTensor)]
        if not tensors:
            return self.func(*args, **kwargs)
        name = f"local_map({_name(self.func)})"
        backend_of(name, tuple(tensors), None)  # one mesh, or monarch's two-mesh error
        mesh = _Mesh.of(self.device_mesh, tensors[0], name)
        for given, what in ((self.in_placements, "in_placements"), (self.in_grad_placements, "in_grad_placements")):
            if given is not None and len(given) != len(args):
                raise ShardingError(f"{name}: {len(given)} {what} for {len(args)} arguments; give one per argument")
        if any(isinstance(v, MeshTensor) for v in kwargs.values()):
            raise ShardingError(f"{name}: MeshTensors go in positional arguments, not keywords")
        moved = [self._input(mesh, name, i, a) for i, a in enumerate(args)]
        grads = None if self.in_grad_placements is None else \
            [mesh.placements(a, g, f"{name} in_grad_placements") if isinstance(a, MeshTensor) else None
             for a, g in zip(moved, self.in_grad_placements, strict=True)]
        multi, outs, values = self._results(name, moved, kwargs)
        keep = tuple(k for k, v in enumerate(values) if isinstance(v, torch.Tensor))
        if not keep:  # nothing to place: func's results do not depend on the pieces' values
            return values[0] if multi is None else multi(values)
        placed = [mesh.placements(values[k], outs[k], f"{name} out_placements") for k in keep]
        picked = None if multi is None else keep
        run = self._run(len(args), picked, grads, placed, kwargs)
        got = run(*moved)
        got = iter(got if isinstance(got, tuple) else (got,))
        results = [next(got) if k in keep else v for k, v in enumerate(values)]
        return results[0] if multi is None else multi(results)

    def _input(self, mesh: _Mesh, name: str, i: int, a: Any) -> Any:
        """Argument `i`, checked against in_placements (redistributed if redistribute_inputs=True)."""
        want = None if self.in_placements is None else self.in_placements[i]
        if not isinstance(a, MeshTensor):
            if want is not None and not isinstance(a, torch.Tensor):
                raise ShardingError(f"{name}: argument {i} ({type(a).__name__}) is no tensor, so its in_placements "
                                    f"entry must be None, not {want!r}")
            return a
        if self.in_placements is None:
            return a
        if want is None:
            raise ShardingError(f"{name}: argument {i} is a MeshTensor, so its in_placements entry needs placements, "
                                "not None")
        ps = mesh.placements(a, want, f"{name} in_placements")
        if ps == a.placements:
            return a
        if not self.redistribute_inputs:
            raise ShardingError(f"{name}: argument {i} is placed {list(a.placements)} but in_placements asks for "
                                f"{list(ps)}; redistribute it first, or pass redistribute_inputs=True")
        return a.redistribute(ps)

    def _results(self, name: str, args: list[Any], kwargs: dict[str, Any]
                 ) -> tuple[type | None, list[Any], list[Any]]:
        """func's result structure (None: one result) and one placement entry and one meta result per result."""
        first = next(a for a in args if isinstance(a, MeshTensor))
        corner = tuple(0 for _ in first.device_mesh.extent.labels)
        metas = [torch.empty(a._spec.local_shape(corner), dtype=a.dtype, device="meta") if isinstance(a, MeshTensor)
                 else a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = self.func(*metas, **kwargs)
        multi = type(out) if isinstance(out, (tuple, list)) else None
        values = list(out) if multi is not None else [out]
        outs = list(self.out_placements) if _many(self.out_placements) else [self.out_placements]
        if len(outs) != len(values):
            raise ShardingError(f"{name}: {len(outs)} out_placements for {len(values)} results; give one per result")
        for k, (v, p) in enumerate(zip(values, outs, strict=True)):
            if not isinstance(v, torch.Tensor) and p is not None:
                raise ShardingError(f"{name}: result {k} ({type(v).__name__}) is no tensor, so its out_placements "
                                    f"entry must be None, not {p!r}")
        return multi, outs, values

    def _run(self, n: int, picked: tuple[int, ...] | None, grads: list[Any] | None,
             placed: list[tuple[Placement, ...]], kwargs: dict[str, Any]) -> Callable[..., Any]:
        """monarch.local_map of func (kept per argument count and result choice while no keywords are given)."""
        key = (n, picked)
        run = self._mapped.get(key) if not kwargs else None
        if run is None:
            fn = self.func if picked is None and not kwargs else _Picked(self.func, picked, tuple(kwargs.items()))
            outs: Any = placed if picked is not None else placed[0]
            run = mapped(fn, [None] * n, outs, grads)
            if not kwargs:
                self._mapped[key] = run
        return run


@dataclass(frozen=True)
class _Mesh:
    """The mesh of a call: the tensors' own, or a submesh of it whose dims positional placements address."""
    labels: tuple[str, ...]
    sub: SubMesh | None

    @staticmethod
    def of(device_mesh: DeviceMeshNames | None, t: MeshTensor, name: str) -> _Mesh:
        root = device_mesh.root if isinstance(device_mesh, SubMesh) else device_mesh
        if root is not None and root is not t.mesh and root != t.mesh:
            raise ShardingError(f"{name}: device_mesh {device_mesh!r} is not the mesh of the MeshTensor arguments, "
                                f"{t.mesh!r}, nor a submesh of it")
        return _Mesh(t.mesh.extent.labels, device_mesh if isinstance(device_mesh, SubMesh) else None)

    def placements(self, t: torch.Tensor, given: PlacementsLike, what: str) -> tuple[Placement, ...]:
        """`given` over the whole mesh (None: Replicate, as DTensor's from_local)."""
        if given is None:
            return (Replicate(),) * len(self.labels)
        return normalize(self.sub.placements(given) if self.sub is not None else given, self.labels, t.ndim, what)


def _many(out_placements: Any) -> bool:
    """Whether out_placements has one entry per result (a tuple or list of placement lists or Nones)."""
    return isinstance(out_placements, (tuple, list)) and bool(out_placements) and \
        not isinstance(out_placements[0], Placement)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", repr(func))
