"""`t.to_mesh(mesh, placements)`: a MeshTensor's shards moved straight from the ranks of its mesh to the ranks
of another, redistributing on the way, never through the controller; differentiable (the gradient goes back
to the source mesh, placed as the source was).

The plan (`plan`) gives each destination rank the byte ranges of the source pieces (Partial dims reduced
first) that overlap its own piece, one replica of each spread over the readers. Eagerly, the source ranks
register their pieces (`monarch::rdma_export`) and answer with small handles, the destination ranks read them
one-sided (`monarch::rdma_pull`), and the pieces are unregistered once every read is done. While a compiled
step is recorded, each source rank registers a stage now (`run_aside`), the source program fills it every
call and the destination program reads it (engine/crossmesh.py), so the step replays with no controller in
between.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Protocol, cast

import torch

from monarch.runtime.control.futures import Future
from monarch.shape import Extent, MeshLike
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Partial, Placement, Replicate, normalize
from monarch.tensor.spec import Spec

PlacementsArg = Mapping[str, Placement] | Sequence[Placement] | None
Box = tuple[tuple[int, int], ...]  # (start, length) per tensor dim


class Side(Protocol):
    """What a move needs of the sessions of both meshes (session.Session)."""
    abstract: Extent
    capturing: bool
    mesh: MeshLike

    @property
    def live(self) -> bool: ...

    def on_ranks(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple], ins: Sequence[MeshTensor] = (),
                 specs: Sequence[Spec | None] = (None,)) -> list[MeshTensor]: ...

    def record_on_ranks(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple],
                        ins: Sequence[MeshTensor] = (), specs: Sequence[Spec | None] = (None,)) -> list[MeshTensor]: ...

    def run_aside(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple]) -> list[Any]: ...

    def values(self, handle: MeshTensor) -> Future[list[Any]]: ...

    def flush(self) -> Any: ...

    def synchronize(self, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class Read:
    """One read of a destination rank: bytes [lo, hi) of source piece `source` (its shape `piece`), of which
    the box `box` (start, length per dim, in piece coordinates) lands at `at` of the destination piece."""
    source: int
    lo: int
    hi: int
    piece: tuple[int, ...]
    box: Box
    at: tuple[int, ...]

    def wire(self, handle: object) -> tuple:
        """What the destination rank's kernel takes (plain values: a worker never loads this module)."""
        return (handle, self.lo, self.hi, self.piece, self.box, self.at)


def to_mesh(src: Side, dst: Side, t: MeshTensor, placements: PlacementsArg) -> MeshTensor:
    """`t` (of session `src`) on the mesh of session `dst` with `placements` (default: replicated), moved rank
    to rank; differentiable."""
    if t.requires_grad and torch.is_grad_enabled():
        return _ToMesh.apply(t, src, dst, placements)
    return move(src, dst, t, placements)


class _ToMesh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: MeshTensor, src: Side, dst: Side, placements: PlacementsArg) -> MeshTensor:
        ctx.back = (dst, src, tuple(Replicate() if isinstance(p, Partial) else p for p in t.placements), t.device.type)
        return move(src, dst, t, placements)

    @staticmethod
    def backward(ctx: Any, grad: MeshTensor) -> tuple[MeshTensor, None, None, None]:
        dst, src, placements, device = ctx.back
        return move(dst, src, grad, placements, device), None, None, None


def move(src: Side, dst: Side, t: MeshTensor, placements: PlacementsArg, device: str | None = None) -> MeshTensor:
    """The move itself, onto `device` (default: `t`'s device type where `dst`'s mesh has it, else the CPU)."""
    target = normalize(placements, dst.abstract.labels, t.ndim, "to_mesh")
    if src is dst:
        return t.redistribute(target)
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in target)
    reduced = tuple(Replicate() if isinstance(p, Partial) else p for p in t.placements)
    source = cast(MeshTensor, t.detach()).redistribute(reduced)
    here = t.device.type
    out = Spec(tuple(t.shape), tuple(source._spec.stride), t.dtype, whole, dst.abstract,
               device or (here if here in ("cpu", dst.mesh.device) else "cpu"))
    src_coords = list(src.abstract.coords())
    plans = [plan(source._spec, src_coords, out, c, n) for n, c in enumerate(dst.abstract.coords())]
    moved = (_staged if src.capturing else _pulled)(src, dst, source, out, plans)
    return moved if whole == target else moved.redistribute(target)


def _pulled(src: Side, dst: Side, source: MeshTensor, out: Spec, plans: list[list[Read]]) -> MeshTensor:
    """Eagerly: the source pieces registered for now, read, then unregistered."""
    exported = src.on_ranks("monarch::rdma_export", _no_args, ins=(source,), specs=(None,))[0]
    handles = src.values(exported).get()

    def reads_of(n: int, coords: tuple[int, ...]) -> tuple:
        return (out.local_shape(coords), out.dtype, tuple(r.wire(handles[r.source]) for r in plans[n]), out.device)
    moved = dst.on_ranks("monarch::rdma_pull", reads_of, specs=(out,))[0]
    dst.synchronize()
    del exported  # every read is done: the source pieces are unregistered with the source's next program
    src.flush()
    return moved


def _staged(src: Side, dst: Side, source: MeshTensor, out: Spec, plans: list[list[Read]]) -> MeshTensor:
    """While a compiled step is recorded: a stage per source rank, registered now and kept, which every call
    of the step fills (source program) and reads (destination program)."""
    site = next(_sites)
    STAGED.append((src, site))
    coords = list(src.abstract.coords())
    readers = [[n for n, reads in enumerate(plans) if any(r.source == i for r in reads)] for i in range(len(coords))]
    nbytes = [prod(source._spec.local_shape(c)) * out.dtype.itemsize for c in coords]
    handles = src.run_aside("monarch::stage_create", lambda i, _: (site, nbytes[i], len(readers[i])))
    src.record_on_ranks("monarch::stage_out", lambda *_: (site,), ins=(source,), specs=())

    def sources_of(n: int, coords: tuple[int, ...]) -> tuple:
        by_source: dict[int, list[tuple]] = {}
        for r in plans[n]:
            by_source.setdefault(r.source, []).append(r.wire(handles[r.source]))
        return (out.local_shape(coords), out.dtype, site, tuple(
            (handles[i], len(readers[i]), readers[i].index(n), tuple(reads)) for i, reads in by_source.items()),
            out.device)
    return dst.record_on_ranks("monarch::stage_in", sources_of, specs=(out,))[0]


_sites = itertools.count(1)  # crossings recorded in compiled steps, numbered for the workers' stages
STAGED: list[tuple[Side, int]] = []  # (source session, site) of the stages made while a step is recorded


def drop_stages(stages: Sequence[tuple[Side, int]]) -> None:
    """Unregister the workers' stages of a compiled step that will not run again (on meshes still running)."""
    for src, site in stages:
        if src.live:
            src.run_aside("monarch::stage_drop", lambda *_, site=site: (site,))


def _no_args(_: int, __: tuple[int, ...]) -> tuple:
    return ()


def plan(source: Spec, src_coords: list[tuple[int, ...]], out: Spec, coords: tuple[int, ...], reader: int
         ) -> list[Read]:
    """The reads that fill the piece of `out` at `coords` from the pieces of `source` (no Partial dims):
    every distinct source piece that overlaps it once, from replica number `reader` mod its replicas."""
    want = out.bounds(coords)
    if prod(n for _, n in want) == 0:
        return []
    reads = []
    for replicas in _distinct(source, src_coords):
        i = replicas[reader % len(replicas)]
        have = source.bounds(src_coords[i])
        box = tuple((max(a, b), min(a + m, b + n) - max(a, b)) for (a, m), (b, n) in zip(have, want, strict=True))
        if any(n <= 0 for _, n in box):
            continue
        piece = tuple(n for _, n in have)
        local = tuple((s - a, n) for (s, n), (a, _) in zip(box, have, strict=True))
        lo, hi = _span(piece, local, source.dtype.itemsize)
        reads.append(Read(i, lo, hi, piece, local, tuple(s - w for (s, _), (w, _) in zip(box, want, strict=True))))
    return reads


def _distinct(spec: Spec, coords: list[tuple[int, ...]]) -> Iterator[list[int]]:
    """Groups of source ranks holding the same piece (they differ only along replicated dims)."""
    groups: dict[Box, list[int]] = {}
    for i, c in enumerate(coords):
        groups.setdefault(spec.bounds(c), []).append(i)
    return iter(groups.values())


def _span(piece: tuple[int, ...], box: Box, itemsize: int) -> tuple[int, int]:
    """The smallest byte range of a C-contiguous piece that holds the box."""
    strides = [prod(piece[d + 1:]) for d in range(len(piece))]
    first = sum(s * st for (s, _), st in zip(box, strides, strict=True))
    last = sum((s + n - 1) * st for (s, n), st in zip(box, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize
