"""Collectives through torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors, one process group per rank
group and backend, made by the group's members only (never the default group, which an actor's own
init_process_group may hold).

A group's first member serves a TCPStore (one per process and address: loopback when the group shares a host, else
the address its peers reach it at) and sends its address to the others over the group's MPI communicator, at the
same members-only point the MPI path creates that communicator; each group and backend meets under its own key
prefix, so groups made in any order on different ranks never wait on each other. Pieces travel as bytes (any
dtype, uneven pieces padded to the largest); gloo reduces in the dtypes the MPI path reduces in (its results equal
MPI's), NCCL in the tensors' own, and a reduction neither has (complex prod, int16) gathers and reduces locally.
NCCL runs on its own CUDA stream, ordered after the caller's by an event; waiting orders the caller's after it.
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from math import prod

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import Backend as Group  # a process group's backend: gloo's or NCCL's

from monarch.program.instr import Comm, Start
from monarch.runtime.control.client import client
from monarch.runtime.engine.transport.mpi import REDUCE, WIDE, reducible, dense, joined, pack, received_shapes, unpack
from monarch.tensor.placement import chunk

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
INTS = {torch.int8, torch.uint8, torch.int32, torch.int64}
NATIVE = {"gloo": frozenset({torch.float32, torch.float64, *INTS}),  # dtypes reduced by every op
          "nccl": frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, *INTS})}
WIDEN = {"gloo": WIDE, "nccl": {}}  # dtypes reduced in a wider one first
LOOPBACK = "127.0.0.1"


class Rendezvous:
    """Where the members of a rank group meet to make its process groups: `comm_for(ranks)` is the group's MPI
    communicator, `local(ranks)` whether all its ranks run on this host."""

    def __init__(self, comm_for: Callable[[tuple[int, ...]], MPI.Intracomm],
                 local: Callable[[tuple[int, ...]], bool]) -> None:
        self.comm_for, self.local = comm_for, local
        self._served: dict[str, tuple[str, int]] = {}  # by address: the store this process serves there
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}  # by (host, port): this process's connections
        self._sockets: list[socket.socket] = []  # the stores' listening sockets, kept open

    def address(self, ranks: tuple[int, ...]) -> str:
        """Where this process listens for the group's peers."""
        return LOOPBACK if self.local(ranks) else client().reach_host()

    def store(self, ranks: tuple[int, ...], backend: str) -> tuple[dist.Store, str]:
        """The group's store under its own prefix, and this process's address for it (collective over `ranks`)."""
        comm, here = self.comm_for(ranks), self.address(ranks)
        where = comm.bcast(self._serve(here) if comm.Get_rank() == 0 else None, root=0)
        store = self._stores.get(where)
        if store is None:
            store = self._stores[where] = dist.TCPStore(where[0], where[1], is_master=False)
        return dist.PrefixStore(f"monarch/{backend}/{'.'.join(map(str, ranks))}", store), here

    def _serve(self, host: str) -> tuple[str, int]:
        """The address of this process's store on `host`, served from a socket bound there (not a wildcard)."""
        hit = self._served.get(host)
        if hit is None:
            sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            self._sockets.append(sock)
            port = sock.getsockname()[1]
            self._stores[(host, port)] = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                                       master_listen_fd=sock.fileno())
            hit = self._served[host] = (host, port)
        return hit


class TorchTransport:
    """Runs one Comm for this rank with torch.distributed's `backend` ("gloo" or "nccl"); `group_of(mdim)` gives
    the world ranks along a mesh dim, in order."""

    def __init__(self, group_of: Callable[[int], tuple[int, ...]], rendezvous: Rendezvous, backend: str) -> None:
        self.group_of, self.rendezvous, self.backend = group_of, rendezvous, backend
        self._groups: dict[tuple[int, ...], Group] = {}

    def name(self, mdim: int) -> str:
        return f"torch-{self.backend}"

    def group(self, mdim: int) -> Group:
        ranks = self.group_of(mdim)
        g = self._groups.get(ranks)
        if g is None:
            g = self._groups[ranks] = self._make(ranks)
        return g

    def _make(self, ranks: tuple[int, ...]) -> Group:
        store, here = self.rendezvous.store(ranks, self.backend)
        me = self.rendezvous.comm_for(ranks).Get_rank()
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, me, len(ranks))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
        return dist.ProcessGroupGloo(store, me, len(ranks), opts)

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        g, x = self.group(ins.mdim), x.resolve_conj().resolve_neg()
        if ins.kind == "all_reduce":
            return self.all_reduce(g, ins.op, x, owned)
        if ins.kind == "reduce_scatter":
            return self.reduce_scatter(g, ins, x)
        return KINDS[ins.kind](g, ins, x)

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Begin the all_reduce of a flat bucket (a fresh copy: reduced in place); the returned callable waits."""
        g = self.group(ins.mdim)
        buf, back = reducible(flat, False, WIDEN[self.backend])
        native = self._native(buf, ins.op)
        if native is None:
            out = self.all_reduce(g, ins.op, flat, True)
            return lambda: out
        work = g.allreduce([native], OPS[ins.op])

        def finish() -> torch.Tensor:
            work.wait()
            return buf.to(back) if back is not None else buf
        return finish

    def _native(self, buf: torch.Tensor, op: str) -> torch.Tensor | None:
        """`buf` as the backend reduces it with `op` (a complex sum as its real pairs), or None where it cannot."""
        if buf.is_complex() and op == "sum":
            return torch.view_as_real(buf)
        return buf if buf.dtype in NATIVE[self.backend] else None

    def all_reduce(self, g: Group, op: str, x: torch.Tensor, owned: bool) -> torch.Tensor:
        buf, back = reducible(x, not owned, WIDEN[self.backend])
        native = self._native(buf, op)
        if native is None:
            buf = gather_reduce(g, op, buf)
        else:
            g.allreduce([native], OPS[op]).wait()
        return buf.to(back) if back is not None else buf

    def reduce_scatter(self, g: Group, ins: Comm, x: torch.Tensor) -> torch.Tensor:
        """Pieces as torch.chunk splits `dim`: rows past the end pad the last pieces to the first's size."""
        buf, back = reducible(x.movedim(ins.dim, 0), False, WIDEN[self.backend])
        k, n, me = g.size(), buf.shape[0], g.rank()
        size = -(-n // k) if n else 0
        if self._native(buf, ins.op) is None:
            mine = gather_reduce(g, ins.op, buf)[chunk(n, k, me)[0]:][:chunk(n, k, me)[1]]
        else:
            padded = buf if size * k == n else torch.cat([buf, buf.new_zeros(size * k - n, *buf.shape[1:])])
            out = padded.new_empty(size, *buf.shape[1:])
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = OPS[ins.op]
            g._reduce_scatter_base(self._native(out, ins.op), self._native(padded, ins.op), opts).wait()
            mine = out[:chunk(n, k, me)[1]]
        out = mine.movedim(0, ins.dim)
        return dense(out, back or out.dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, flat."""
    return t.reshape(-1).view(torch.uint8)


def gather_reduce(g: Group, op: str, buf: torch.Tensor) -> torch.Tensor:
    """The reduction of every member's `buf` by `op`, computed here from all of them, in member order."""
    parts = buf.new_empty(g.size(), *buf.shape)
    g._allgather_base(raw(parts), raw(buf.contiguous())).wait()
    acc = parts[0]
    for p in parts[1:]:
        acc = REDUCE[op](acc, p)
    return acc


def all_gather(g: Group, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    counts = [prod(s) for s in ins.shapes]
    most = max(counts)
    piece = x.movedim(ins.dim, 0).contiguous()
    if most == min(counts):
        recv = x.new_empty(sum(counts))
        g._allgather_base(raw(recv), raw(piece)).wait()
        return joined(recv, counts, list(ins.shapes), ins.dim)
    send = x.new_empty(most)
    send[:piece.numel()] = piece.reshape(-1)
    recv = x.new_empty(len(counts), most)
    g._allgather_base(raw(recv), raw(send)).wait()
    return unpack([r[:c] for r, c in zip(recv, counts, strict=True)], list(ins.shapes), ins.dim, x.dtype)


def all_to_all(g: Group, ins: Comm, x: torch.Tensor) -> torch.Tensor:
    k, me, item = len(ins.shapes), g.rank(), x.element_size()
    parts = [x.narrow(ins.dim, *chunk(x.shape[ins.dim], k, j)) for j in range(k)]
    send = x.new_empty(x.numel())
    pack(send, parts, ins.cat_dim)
    recv_shapes = received_shapes(ins, me)
    rcounts = [prod(s) for s in recv_shapes]
    recv = x.new_empty(sum(rcounts))
    g.alltoall_base(raw(recv), raw(send), [c * item for c in rcounts], [p.numel() * item for p in parts]).wait()
    return joined(recv, rcounts, recv_shapes, ins.cat_dim)


KINDS = {"all_gather": all_gather, "all_to_all": all_to_all}
