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
RAW = {torch.bfloat16: torch.int16}


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

    def __call__(self, ins: Comm, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm_for(self.group_of(ins.mdim))
        return KINDS[ins.kind](comm, ins, x.resolve_conj().resolve_neg())

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Begin a non-blocking all_reduce of a flat bucket; the returned callable waits for it."""
        buf, back = _reducible(flat)
        req = self.comm_for(self.group_of(ins.mdim)).Iallreduce(MPI.IN_PLACE, _np(buf), op=OPS[ins.op])

        def finish() -> torch.Tensor:
            req.Wait()
            return buf.to(back) if back is not None else buf
        return finish


def _np(t: torch.Tensor):  # noqa: ANN202 - a numpy view of a contiguous tensor's memory
    return t.view(RAW[t.dtype]).numpy() if t.dtype in RAW else t.numpy()


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous()


def all_gather(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    counts = [prod(s) for s in ins.shapes]
    send = _front(x, ins.dim)
    recv = torch.empty(sum(counts), dtype=x.dtype)
    comm.Allgatherv(_np(send), [_np(recv), counts])
    pieces, at = [], 0
    for shape, n in zip(ins.shapes, counts, strict=True):
        moved = (shape[ins.dim], *shape[:ins.dim], *shape[ins.dim + 1:])
        pieces.append(recv[at:at + n].view(moved))
        at += n
    return torch.cat(pieces, 0).movedim(0, ins.dim).contiguous()


def all_reduce(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    buf, back = _reducible(x)
    comm.Allreduce(MPI.IN_PLACE, _np(buf), op=OPS[ins.op])
    return buf.to(back) if back is not None else buf


def reduce_scatter(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    buf, back = _reducible(_front(x, ins.dim))
    k, n = len(ins.shapes), x.shape[ins.dim]
    rest = prod(buf.shape[1:])
    counts = [chunk(n, k, i)[1] * rest for i in range(k)]
    me = comm.Get_rank()
    recv = torch.empty(counts[me], dtype=buf.dtype)
    comm.Reduce_scatter(_np(buf), _np(recv), counts, op=OPS[ins.op])
    out = recv.view(chunk(n, k, me)[1], *buf.shape[1:]).movedim(0, ins.dim).contiguous()
    return out.to(back) if back is not None else out


def all_to_all(comm: MPI.Intracomm, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    k, me = len(ins.shapes), comm.Get_rank()
    n = x.shape[ins.dim]
    sends = [_front(x.narrow(ins.dim, *chunk(n, k, j)), ins.cat_dim) for j in range(k)]
    send = torch.cat([s.reshape(-1) for s in sends]) if sends else x.new_empty(0)
    mine = chunk(n, k, me)[1]
    recv_shapes = [tuple(mine if d == ins.dim else s for d, s in enumerate(shape)) for shape in ins.shapes]
    rcounts = [prod(s) for s in recv_shapes]
    recv = torch.empty(sum(rcounts), dtype=x.dtype)
    comm.Alltoallv([_np(send), [s.numel() for s in sends]], [_np(recv), rcounts])
    pieces, at = [], 0
    for shape, c in zip(recv_shapes, rcounts, strict=True):
        moved = (shape[ins.cat_dim], *shape[:ins.cat_dim], *shape[ins.cat_dim + 1:])
        pieces.append(recv[at:at + c].view(moved))
        at += c
    return torch.cat(pieces, 0).movedim(0, ins.cat_dim).contiguous()


def _reducible(x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """A private contiguous copy MPI can reduce, and the dtype to convert the result back to."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.to(torch.float32).contiguous(), x.dtype
    if x.dtype == torch.bool:
        return x.to(torch.uint8).contiguous(), torch.bool
    return x.clone(memory_format=torch.contiguous_format), None


KINDS = {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter,
         "all_to_all": all_to_all}
