"""Collectives between the ranks of one host by cross-memory attach: each member reads what it needs straight
from its peers' tensors with process_vm_readv (one copy, no staging segment).

A collective opens with one Allgather of the members' buffer addresses on the group's communicator (also its
entry barrier) and closes with a barrier (peers may still be reading this member's buffers). Pieces are laid
out as the MPI path lays them out (mpi.py), reductions run in the dtype it reduces in, chunk by chunk so that a
peer's bytes are reduced while they are in cache; each member starts from its own piece.
"""
from __future__ import annotations

import os
import secrets
from math import prod

import torch
from mpi4py import MPI

from monarch.errors import TransportError
from monarch.program.instr import Comm
from monarch.runtime.engine.transport import cma
from monarch.runtime.engine.transport.mpi import (REDUCE, WIDE, dense, front_shape, joined, pack, part_shape,
                                                  received_shapes)
from monarch.tensor.placement import chunk

CHUNK = 1 << 20  # bytes of a peer's piece read and reduced at a time


class Peers:
    """A group whose members may read each other's memory: its communicator and every member's pid."""

    def __init__(self, comm: MPI.Intracomm, pids: list[int]) -> None:
        self.comm, self.pids = comm, pids
        self.k, self.me = comm.Get_size(), comm.Get_rank()
        self.others = [r for r in range(self.k) if r != self.me]

    @classmethod
    def probe(cls, comm: MPI.Intracomm) -> Peers | None:
        """The group's peers if this kernel lets every member read every other's memory, else None (all
        members agree: collective over `comm`)."""
        token = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
        table = publish(comm, os.getpid(), token.data_ptr(), int(token))
        got, ok = torch.empty(1, dtype=torch.int64), True
        for r, (pid, addr, want) in enumerate(table.tolist()):
            try:
                cma.read_memory(pid, addr, got.data_ptr(), 8)
                ok = ok and (r == comm.Get_rank() or int(got) == want)
            except (cma.Refused, OSError):
                ok = False
        ok = comm.allreduce(ok, op=MPI.LAND)
        return cls(comm, [pid for pid, _, _ in table.tolist()]) if ok else None

    def read(self, r: int, addr: int, dst: torch.Tensor) -> torch.Tensor:
        """Member r's bytes at `addr`, as many as the contiguous `dst` holds, copied into `dst`."""
        try:
            cma.read_memory(self.pids[r], addr, dst.data_ptr(), dst.nbytes)
        except (cma.Refused, OSError) as e:
            raise TransportError(f"collective over ranks of one host: reading member {r} (pid {self.pids[r]}) "
                                 f"failed ({e!r}); it exited, or the kernel stopped allowing process_vm_readv; "
                                 "set MONARCH_TRANSPORT=mpi to avoid cross-memory attach") from None
        return dst


def publish(comm: MPI.Intracomm, *values: int) -> torch.Tensor:
    """Every member's `values` (addresses), one row per member: an Allgather, which is also a barrier."""
    mine = torch.tensor(values, dtype=torch.int64)
    table = torch.empty(comm.Get_size(), len(values), dtype=torch.int64)
    comm.Allgather(mine.numpy(), table.numpy())
    return table


def reduce_range(g: Peers, op: str, mine: torch.Tensor, addrs: list[int], lo: int, dst: torch.Tensor) -> None:
    """`dst` = elements [lo, lo + len(dst)) of every member's flat input reduced, `mine` being this member's
    (`dst` may be that range of `mine`); member r's input lies at `addrs[r]`."""
    fn, wide, item, n = REDUCE[op], WIDE.get(mine.dtype), mine.dtype.itemsize, dst.numel()
    step = max(1, CHUNK // item)
    scratch = torch.empty(min(step, n), dtype=mine.dtype)
    acc = torch.empty(min(step, n), dtype=wide) if wide is not None else None
    for at in range(0, n, step):
        m = min(step, n - at)
        own, out = mine[lo + at:lo + at + m], dst[at:at + m]
        if acc is not None:  # reduced in the wider dtype, rounded once
            own = acc[:m].copy_(own)
        target = acc[:m] if acc is not None else out
        if not g.others:
            target.copy_(own)
        for r in g.others:
            fn(own, g.read(r, addrs[r] + (lo + at) * item, scratch[:m]), out=target)
            own = target
        if acc is not None:
            out.copy_(acc[:m])


def gather(g: Peers, src: torch.Tensor, addrs: list[int], offsets: list[int], counts: list[int],
           dst: torch.Tensor) -> None:
    """Member r's elements [offsets[r], + counts[r]) at `addrs[r]`, one after the other in member order, into
    the flat `dst` (this member's own from `src`)."""
    at = 0
    for r, (off, c) in enumerate(zip(offsets, counts, strict=True)):
        if r == g.me:
            dst[at:at + c].copy_(src[off:off + c])
        elif c:
            g.read(r, addrs[r] + off * src.dtype.itemsize, dst[at:at + c])
        at += c


def all_reduce(g: Peers, op: str, x: torch.Tensor, owned: bool) -> torch.Tensor:
    """Member i reduces slice i into its output (in place where it owns the input or made it contiguous), then
    reads the other reduced slices from the peers' outputs."""
    src = x.contiguous().view(-1)
    out = src if owned or not x.is_contiguous() else torch.empty_like(src)
    n, item = src.numel(), src.dtype.itemsize
    table = publish(g.comm, src.data_ptr(), out.data_ptr()).tolist()
    lo, size = chunk(n, g.k, g.me)
    reduce_range(g, op, src, [a for a, _ in table], lo, out[lo:lo + size])
    g.comm.Barrier()
    for r in g.others:
        at, c = chunk(n, g.k, r)
        if c:
            g.read(r, table[r][1] + at * item, out[at:at + c])
    g.comm.Barrier()
    return out.view(x.shape)


def reduce_scatter(g: Peers, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    src = x.movedim(ins.dim, 0).contiguous()
    rows = x.shape[ins.dim]
    rest = src.numel() // rows if rows else 0
    lo, size = chunk(rows, g.k, g.me)
    out = torch.empty(size * rest, dtype=x.dtype)
    addrs = publish(g.comm, src.data_ptr()).view(-1).tolist()
    reduce_range(g, ins.op, src.view(-1), addrs, lo * rest, out)
    g.comm.Barrier()
    return dense(out.view(size, *front_shape(tuple(x.shape), ins.dim)[1:]).movedim(0, ins.dim), x.dtype)


def all_gather(g: Peers, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    src = x.movedim(ins.dim, 0).contiguous().view(-1)
    counts = [prod(s) for s in ins.shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype)
    addrs = publish(g.comm, src.data_ptr()).view(-1).tolist()
    gather(g, src, addrs, [0] * g.k, counts, recv)
    g.comm.Barrier()
    return joined(recv, counts, list(ins.shapes), ins.dim)


def all_to_all(g: Peers, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    """Each member packs its k parts as the MPI path sends them; member i reads part i of every member's."""
    parts = [x.narrow(ins.dim, *chunk(x.shape[ins.dim], g.k, j)) for j in range(g.k)]
    send = torch.empty(x.numel(), dtype=x.dtype)
    pack(send, parts, ins.cat_dim)
    shapes = received_shapes(ins, g.me)
    counts = [prod(s) for s in shapes]
    offsets = [sum(prod(part_shape(s, ins.dim, g.k, j)) for j in range(g.me)) for s in ins.shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype)
    addrs = publish(g.comm, send.data_ptr()).view(-1).tolist()
    gather(g, send, addrs, offsets, counts, recv)
    g.comm.Barrier()
    return joined(recv, counts, shapes, ins.cat_dim)


def run(g: Peers, ins: Comm, x: torch.Tensor, owned: bool) -> torch.Tensor:
    """This member's part of `ins` on `x` (conjugate and negative views materialized: peers read raw bytes)."""
    y = x.resolve_conj().resolve_neg()
    if ins.kind == "all_reduce":
        return all_reduce(g, ins.op, y, owned or y is not x)
    return KINDS[ins.kind](g, ins, y)


KINDS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
