"""Collectives between the ranks of one host: through a shared-memory segment per group (MPI-3 shared windows),
and from MONARCH_ATTACH_BYTES on by cross-memory attach (attach.py) where the kernel lets the members read each other's
memory (probed once per group; where it does not, said once on stderr).

With a segment, each member owns a slot of its group's segment and sees every slot as a torch view. A collective writes
this rank's piece into its slot (the one copy in), waits on a barrier of the group's communicator, then
reads or reduces the slots in place (torch ops on views: no pickling, no MPI data transfer). Every member
knows every piece's shape from the Comm, so all of them grow the segment together, without a handshake.
Reductions run in the dtype the MPI path reduces in (float32 for bfloat16 and float16, uint8 for bool).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from math import prod

import torch
from mpi4py import MPI

from monarch import config
from monarch.program.instr import Comm, Start
from monarch.runtime.engine.transport import attach
from monarch.runtime.engine.transport.attach import Peers
from monarch.runtime.engine.transport.mpi import (REDUCE, WIDE, dense, front_shape, pack, part_shape, received_shapes,
                                                  unpack)
from monarch.runtime.engine.transport.registry import allow_cross_memory_readers
from monarch.tensor.placement import chunk

ALIGN = 4096  # slot sizes are multiples of a page: every slot starts aligned for any dtype


def shares_memory(comm: MPI.Intracomm) -> bool:
    """Whether all members of `comm` run on this host (collective over its members)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size() == comm.Get_size()
    node.Free()
    return local


class Segment:
    """A group's shared window: one slot per member, all of the same size, grown collectively."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.win: MPI.Win | None = None
        self.size = 0
        self.slots: list[torch.Tensor] = []

    def ensure(self, nbytes: int) -> None:
        """Make every slot hold at least `nbytes` (all members call it with the same value)."""
        if self.win is not None and nbytes <= self.size:
            return
        self.free()
        size = -(-max(nbytes, 2 * self.size, 1) // ALIGN) * ALIGN  # never empty: a collective of empty pieces
        self.win = MPI.Win.Allocate_shared(size, 1, comm=self.comm)
        self.slots = [torch.frombuffer(self.win.Shared_query(r)[0], dtype=torch.uint8, count=size)
                      for r in range(self.comm.Get_size())]
        self.size = size

    def slot(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first `numel` elements of member `rank`'s slot, as a flat `dtype` view."""
        return self.slots[rank][:numel * dtype.itemsize].view(dtype)

    def free(self) -> None:
        self.slots = []  # no view of the window outlives it
        if self.win is not None:
            self.win.Free()
            self.win, self.size = None, 0


class ShmTransport:
    """Runs one Comm for this rank by cross-memory attach or through its group's segment; `comm_of(mdim)` gives
    the group's communicator."""

    def __init__(self, comm_of: Callable[[int], MPI.Intracomm]) -> None:
        self.comm_of = comm_of
        self._groups: dict[int, tuple[Segment, Peers | None]] = {}  # by communicator handle
        # from this size a collective's one copy by cross-memory attach beats the segment's two, whose copies
        # below it stay in cache while process_vm_readv pins every page
        self.attach_bytes = config.attach_bytes()
        allow_cross_memory_readers()

    def name(self, mdim: int) -> str:
        return "shm"

    def group(self, mdim: int) -> tuple[Segment, Peers | None]:
        """The group's segment, and its peers where they may read each other's memory."""
        comm = self.comm_of(mdim)
        g = self._groups.get(comm.py2f())
        if g is None:
            peers = Peers.probe(comm)
            if peers is None:
                _say_refused()
            g = self._groups[comm.py2f()] = (Segment(comm), peers)
        return g

    def way(self, mdim: int, nbytes: int) -> Segment | Peers:
        """How a collective whose largest tensor has `nbytes` runs (the same on every member)."""
        seg, peers = self.group(mdim)
        return peers if peers is not None and nbytes >= self.attach_bytes else seg

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        sizes = [prod(s) for s in ins.shapes]
        g = self.way(ins.mdim, (sum(sizes) if ins.kind == "all_gather" else max(sizes)) * x.dtype.itemsize)
        if isinstance(g, Peers):
            return attach.run(g, ins, x, owned)
        if ins.kind == "all_reduce":
            return all_reduce(g, ins.op, x, owned)
        return KINDS[ins.kind](g, ins, x)

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The bucket's all_reduce, run now into `flat` (cheap within a host); the callable returns it."""
        g = self.way(ins.mdim, flat.nbytes)
        out = attach.all_reduce(g, ins.op, flat, True) if isinstance(g, Peers) else all_reduce(g, ins.op, flat, True)
        return lambda: out

    def close(self) -> None:
        """Free every segment (collective over each group: all members close together)."""
        for seg, _ in self._groups.values():
            seg.free()
        self._groups.clear()


@functools.cache
def _say_refused() -> None:
    print("monarch: the ranks of this host may not read each other's memory (process_vm_readv refused: Yama's "
          "kernel.yama.ptrace_scope above 1, a seccomp policy, or no CAP_SYS_PTRACE across containers); their "
          "collectives go through shared-memory windows instead, with one more copy each way", file=sys.stderr,
          flush=True)


def _reduce(srcs: list[torch.Tensor], op: str, out: torch.Tensor) -> None:
    """`out` = srcs[0] op srcs[1] op ... in member order (`out` may be srcs[0])."""
    fn = REDUCE[op]
    if len(srcs) == 1:
        out.copy_(srcs[0])
        return
    fn(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        fn(out, s, out=out)


def all_reduce(seg: Segment, op: str, x: torch.Tensor, owned: bool) -> torch.Tensor:
    """Each member reduces its 1/k of the elements across all slots into slot 0, which all then read
    (into `x` itself when `owned`: its pages are already mapped, a new tensor's are not)."""
    comm, dtype = seg.comm, WIDE.get(x.dtype, x.dtype)
    k, me, n = comm.Get_size(), comm.Get_rank(), x.numel()
    seg.ensure(n * dtype.itemsize)
    comm.Barrier()  # every member has read the segment's previous contents
    seg.slot(me, dtype, n).view(x.shape).copy_(x)
    comm.Barrier()
    lo, size = chunk(n, k, me)
    _reduce([seg.slot(r, dtype, n)[lo:lo + size] for r in range(k)], op, seg.slot(0, dtype, n)[lo:lo + size])
    comm.Barrier()
    out = x if owned and x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
    return out.copy_(seg.slot(0, dtype, n).view(x.shape))


def reduce_scatter(seg: Segment, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    comm, dtype = seg.comm, WIDE.get(x.dtype, x.dtype)
    k, me, n = comm.Get_size(), comm.Get_rank(), x.numel()
    seg.ensure(n * dtype.itemsize)
    comm.Barrier()
    pack(seg.slot(me, dtype, n), [x], ins.dim)
    comm.Barrier()
    rows = x.shape[ins.dim]
    rest = n // rows if rows else 0
    lo, size = chunk(rows, k, me)
    acc = torch.empty(size * rest, dtype=dtype)
    _reduce([seg.slot(r, dtype, n)[lo * rest:(lo + size) * rest] for r in range(k)], ins.op, acc)
    out = acc.view(size, *front_shape(tuple(x.shape), ins.dim)[1:]).movedim(0, ins.dim)
    return dense(out, x.dtype)


def all_gather(seg: Segment, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    comm, me = seg.comm, seg.comm.Get_rank()
    counts = [prod(s) for s in ins.shapes]
    seg.ensure(max(counts) * x.dtype.itemsize)
    comm.Barrier()
    pack(seg.slot(me, x.dtype, x.numel()), [x], ins.dim)
    comm.Barrier()
    return unpack([seg.slot(r, x.dtype, c) for r, c in enumerate(counts)], list(ins.shapes), ins.dim, x.dtype)


def all_to_all(seg: Segment, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    """Each member packs its k parts (split along `dim`) into its slot; member i reads part i of every slot."""
    comm = seg.comm
    k, me = comm.Get_size(), comm.Get_rank()
    seg.ensure(max(prod(s) for s in ins.shapes) * x.dtype.itemsize)
    comm.Barrier()
    pack(seg.slot(me, x.dtype, x.numel()), [x.narrow(ins.dim, *chunk(x.shape[ins.dim], k, j)) for j in range(k)],
         ins.cat_dim)
    comm.Barrier()
    shapes = received_shapes(ins, me)
    flats = []
    for r, shape in enumerate(ins.shapes):
        at = sum(prod(part_shape(shape, ins.dim, k, j)) for j in range(me))
        flats.append(seg.slot(r, x.dtype, prod(shape))[at:at + prod(shapes[r])])
    return unpack(flats, shapes, ins.cat_dim, x.dtype)


KINDS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
