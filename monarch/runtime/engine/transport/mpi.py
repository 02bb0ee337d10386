"""Collectives over MPI on torch tensors' own buffers (no pickling), one communicator per rank group.

Each collective makes its piece contiguous with the dim it concatenates along moved to the front, so
every member's piece is one flat run of elements; uneven pieces become the counts of the v-variants
(Allgatherv, Reduce_scatter, Alltoallv). Communicators are created once per group of world ranks with
MPI_Comm_create_group, which only the members take part in. dtypes numpy lacks travel as raw bits
(bfloat16 as int16) and are reduced in float32; lazy conjugate and negative views (`x.conj()`, which
numpy cannot read) are materialized first.
"""
from __future__ import annotations

from collections.abc import Callable
from math import prod

import torch
from mpi4py import MPI

from monarch.program.instr import Comm, Start
from monarch.tensor.placement import chunk

OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
REDUCE: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum,
                                                  "prod": torch.mul}  # the same reductions in torch
RAW = {torch.bfloat16: torch.int16}
WIDE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.bool: torch.uint8}  # reduced as


class MpiTransport:
    """Runs one Comm for this rank; `group_of(mdim)` gives the world ranks along a mesh dim, in order."""

    def __init__(self, group_of: Callable[[int], tuple[int, ...]]) -> None:
        self.group_of = group_of
        self._comms: dict[tuple[int, ...], MPI.Intracomm] = {}
        self._world = MPI.COMM_WORLD

    def comm_for(self, ranks: tuple[int, ...]) -> MPI.Intracomm:
        c = self._comms.get(ranks)
        if c is None:
            group = self._world.Get_group().Incl(list(ranks))
            c = self._comms[ranks] = self._world.Create_group(group)
            group.Free()
        return c

    def name(self, mdim: int) -> str:
        return "mpi"

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        comm = self.comm_for(self.group_of(ins.mdim))
        if ins.kind == "all_reduce":
            return all_reduce(comm, ins.op, x.resolve_conj().resolve_neg(), owned)
        return KINDS[ins.kind](comm, ins, x.resolve_conj().resolve_neg())

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Begin a non-blocking all_reduce of a flat bucket; the returned callable waits for it."""
        buf, back = reducible(flat, private=False)  # the bucket is a fresh flat copy: reduced in place
        req = self.comm_for(self.group_of(ins.mdim)).Iallreduce(MPI.IN_PLACE, _np(buf), op=OPS[ins.op])

        def finish() -> torch.Tensor:
            req.Wait()
            return buf.to(back) if back is not None else buf
        return finish


def _np(t: torch.Tensor):  # noqa: ANN202 - a numpy view of a contiguous tensor's memory
    return t.view(RAW[t.dtype]).numpy() if t.dtype in RAW else t.numpy()


def front_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """`shape` with `dim` moved to the front: the layout a piece travels in."""
    return (shape[dim], *shape[:dim], *shape[dim + 1:])


def pack(dst: torch.Tensor, parts: list[torch.Tensor], dim: int) -> None:
    """Write `parts` one after the other into the flat `dst`, each with `dim` moved to the front (one copy)."""
    at = 0
    for p in parts:
        moved = p.movedim(dim, 0)
        dst[at:at + p.numel()].view(moved.shape).copy_(moved)
        at += p.numel()


def unpack(flats: list[torch.Tensor], shapes: list[tuple[int, ...]], dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The pieces `flats` (each laid out by `front_shape(shape, dim)`) concatenated along `dim` (one copy)."""
    first = shapes[0]
    out = torch.empty((*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1:]), dtype=dtype,
                      device=flats[0].device)
    at = 0
    for flat, shape in zip(flats, shapes, strict=True):
        out.narrow(dim, at, shape[dim]).copy_(flat.view(front_shape(shape, dim)).movedim(0, dim))
        at += shape[dim]
    return out


def dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` contiguous in `dtype`: itself when it already is, else one copy that converts and lays it out."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def joined(recv: torch.Tensor, counts: list[int], shapes: list[tuple[int, ...]], dim: int) -> torch.Tensor:
    """The pieces received one after the other in the flat `recv` (each laid out by `front_shape`), concatenated
    along `dim`: `recv` itself, viewed, when `dim` is 0."""
    if dim == 0:
        return recv.view(sum(s[0] for s in shapes), *shapes[0][1:])
    return unpack(list(recv.split(counts)) if counts else [], shapes, dim, recv.dtype)


def all_gather(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    counts = [prod(s) for s in ins.shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype)
    comm.Allgatherv(_np(x.movedim(ins.dim, 0).contiguous()), [_np(recv), counts])
    return joined(recv, counts, list(ins.shapes), ins.dim)


def all_reduce(comm: MPI.Intracomm, op: str, x: torch.Tensor, owned: bool) -> torch.Tensor:
    buf, back = reducible(x, private=not owned)
    comm.Allreduce(MPI.IN_PLACE, _np(buf), op=OPS[op])
    return buf.to(back) if back is not None else buf


def reduce_scatter(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    buf, back = reducible(x.movedim(ins.dim, 0), private=False)
    k, n = len(ins.shapes), x.shape[ins.dim]
    rest = prod(buf.shape[1:])
    counts = [chunk(n, k, i)[1] * rest for i in range(k)]
    me = comm.Get_rank()
    recv = torch.empty(counts[me], dtype=buf.dtype)
    comm.Reduce_scatter(_np(buf), _np(recv), counts, op=OPS[ins.op])
    out = recv.view(chunk(n, k, me)[1], *buf.shape[1:]).movedim(0, ins.dim)
    return dense(out, back or out.dtype)


def all_to_all(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    k, me = len(ins.shapes), comm.Get_rank()
    parts = [x.narrow(ins.dim, *chunk(x.shape[ins.dim], k, j)) for j in range(k)]
    send = torch.empty(x.numel(), dtype=x.dtype)
    pack(send, parts, ins.cat_dim)
    recv_shapes = received_shapes(ins, me)
    rcounts = [prod(s) for s in recv_shapes]
    recv = torch.empty(sum(rcounts), dtype=x.dtype)
    comm.Alltoallv([_np(send), [p.numel() for p in parts]], [_np(recv), rcounts])
    return joined(recv, rcounts, recv_shapes, ins.cat_dim)


def received_shapes(ins: Comm, me: int) -> list[tuple[int, ...]]:
    """all_to_all: the shape of the piece member `me` receives from each member, in group order."""
    return [part_shape(s, ins.dim, len(ins.shapes), me) for s in ins.shapes]


def part_shape(shape: tuple[int, ...], dim: int, k: int, j: int) -> tuple[int, ...]:
    """The shape of part j of k when `shape` is split along `dim` as torch.chunk splits it."""
    return tuple(chunk(shape[dim], k, j)[1] if d == dim else n for d, n in enumerate(shape))


def reducible(x: torch.Tensor, private: bool,
              widen: dict[torch.dtype, torch.dtype] = WIDE) -> tuple[torch.Tensor, torch.dtype | None]:
    """`x` contiguous in a dtype MPI (or the transport whose `widen` is given) can reduce (a copy of its own when
    `private`: it is reduced in place), and the dtype to convert the result back to."""
    wide = widen.get(x.dtype)
    if wide is not None:
        return x.to(wide, memory_format=torch.contiguous_format), x.dtype
    return (x.clone(memory_format=torch.contiguous_format) if private else x.contiguous()), None


KINDS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
