"""Run under `mpiexec -n K`: random collectives through the MPI and the shared-memory transports of every
rank, and by cross-memory attach whatever their size, checked against each other and against plain torch;
prints one line per rank ("ok N" or the failure).
With `refused`, a seccomp filter first makes this kernel refuse process_vm_readv (EPERM), as Yama would."""
from __future__ import annotations

import ctypes
import errno
import platform
import random
import struct
import sys
from collections.abc import Callable

import torch
from mpi4py import MPI

from monarch.program.instr import Comm, Start
from monarch.runtime.engine.transport.mpi import MpiTransport
from monarch import config
from monarch.runtime.engine.transport import attach
from monarch.runtime.engine.transport.attach import Peers
from monarch.runtime.engine.transport.shm import Segment, ShmTransport
from monarch.tensor.placement import chunk

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64]
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "bucket"]
Way = Callable[[Comm | Start, torch.Tensor, bool], torch.Tensor]  # a collective or a bucket (owned), its result


def full(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Member-specific data, the same on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g) if not dtype.is_floating_point and not dtype.is_complex else None
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if x is not None:
        return x.to(dtype)
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def want_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    wide = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.bool: torch.uint8}.get(xs[0].dtype)
    acc = xs[0].to(wide) if wide else xs[0].clone()
    for x in xs[1:]:
        y = x.to(wide) if wide else x
        acc = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}[op](acc, y)
    return acc.to(xs[0].dtype)


def case(rng: random.Random, k: int, me: int, step: int) -> tuple[str, Comm | Start, list[torch.Tensor], torch.Tensor]:
    kind, dtype = rng.choice(KINDS), rng.choice(DTYPES)
    op = "sum" if dtype.is_complex else rng.choice(["sum", "max", "min", "prod"])
    ndim = rng.randint(1, 3)
    base = [rng.randint(1, 6) for _ in range(ndim)]
    if rng.random() < 0.05:  # pieces over a megabyte: reductions run in several chunks
        base[-1] *= 100_000 + rng.randint(0, 999)
    dim, cat = rng.randrange(ndim), rng.randrange(ndim)
    uneven = kind == "all_gather" and rng.random() < 0.5
    shapes = tuple(tuple(b if d != dim or not uneven else random.Random(step * 31 + r).randint(0, 6)
                         for d, b in enumerate(base)) for r in range(k)) if uneven else (tuple(base),) * k
    xs = [full(step * 100 + r, shapes[r], dtype) for r in range(k)]
    if rng.random() < 0.3 and ndim > 1:  # a strided piece: transposed storage
        xs = [x.mT.contiguous().mT for x in xs]
    if dtype.is_complex and rng.random() < 0.5:
        xs = [x.conj() for x in xs]
    if kind == "all_reduce":
        return kind, Comm(kind, 1, 2, 0, shapes, dtype, op=op), xs, want_reduce(xs, op)
    if kind == "bucket":
        return kind, Start((1,), (2,), 0, op, dtype, (shapes[0],)), xs, want_reduce(xs, op).reshape(-1)
    if kind == "all_gather":
        return kind, Comm(kind, 1, 2, 0, shapes, dtype, dim=dim), xs, torch.cat([x.resolve_conj() for x in xs], dim)
    if kind == "reduce_scatter":
        return kind, Comm(kind, 1, 2, 0, shapes, dtype, dim=dim, op=op), xs, \
            want_reduce(xs, op).narrow(dim, *chunk(base[dim], k, me))
    want = torch.cat([x.resolve_conj().narrow(dim, *chunk(base[dim], k, me)) for x in xs], cat)
    return kind, Comm(kind, 1, 2, 0, shapes, dtype, dim=dim, cat_dim=cat), xs, want


def refuse_cross_memory_reads() -> None:
    """Install a seccomp filter on this thread: process_vm_readv fails with EPERM, everything else runs."""
    nr = {"x86_64": 310, "aarch64": 270}[platform.machine()]

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)
    prog = op(0x20, 0) + op(0x15, nr, 0, 1) + op(0x06, 0x00050000 | errno.EPERM) + op(0x06, 0x7FFF0000)
    code = ctypes.create_string_buffer(prog)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
    assert libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, ctypes.addressof(code))), 0, 0) == 0, \
        f"PR_SET_SECCOMP: errno {ctypes.get_errno()}"


def way_of(t: MpiTransport | ShmTransport) -> Way:
    """A transport's collectives and buckets as one Way."""
    return lambda ins, x, owned: t.start(ins, x)() if isinstance(ins, Start) else t(ins, x, owned)


def check_ways(ways: dict[str, Way], rng: random.Random, n: int, k: int, me: int) -> None:
    """`n` random cases through every way: each equals plain torch (exactly where the sums' order cannot matter),
    and then the "mpi" way's result; in place equals out of place; no input changes."""
    for step in range(n):
        kind, ins, xs, want = case(rng, k, me, step)
        x = xs[me]
        got = {}
        for who, way in ways.items():
            if kind == "bucket":
                got[who] = way(ins, x.reshape(-1).clone(), True)
                continue
            got[who] = way(ins, x, False)
            if kind == "all_reduce":  # an input no one reads afterwards is reduced in place
                assert torch.equal(way(ins, x.clone(), True), got[who]), f"{who} {ins!r}: in place differs"
        assert torch.equal(x, xs[me]), f"{ins!r}: the input changed"
        inexact = ins.dtype.is_floating_point or ins.dtype.is_complex
        exact = k <= 2 or not inexact or kind in ("all_gather", "all_to_all")
        for who, out in got.items():
            assert out.dtype == want.dtype and out.shape == want.shape, f"{who} {ins!r}: {out.shape} {want.shape}"
            assert out.is_contiguous(), f"{who} {ins!r}: not contiguous"
            tol = {} if exact else {"rtol": 1e-2, "atol": 1e-2}
            torch.testing.assert_close(out, want, equal_nan=True, **(tol or {"rtol": 0, "atol": 0}),
                                       msg=lambda m: f"{who} {ins!r}: {m}")
            if exact:
                a = got["mpi"]
                assert torch.equal(a, out) or (a.isnan() & out.isnan()).any(), f"{ins!r}: mpi and {who} differ"


def main(seed: int, n: int, refused: bool) -> None:
    world = MPI.COMM_WORLD
    k, me = world.Get_size(), world.Get_rank()
    ranks = tuple(range(k))
    mpi = MpiTransport(lambda mdim: ranks)
    if refused:
        refuse_cross_memory_reads()
    shm = ShmTransport(lambda mdim: mpi.comm_for(ranks))
    peers = shm.group(0)[1]
    assert (peers is None) == refused and isinstance(shm.way(0, config.attach_bytes()), Segment if refused else Peers)
    ways: dict[str, Way] = {"mpi": way_of(mpi), "shm": way_of(shm)}
    if peers is not None:  # every size by cross-memory attach, beside the transport's own choice by size
        ways["attach"] = lambda ins, x, owned: attach.all_reduce(peers, ins.op, x, True) if isinstance(ins, Start) \
            else attach.run(peers, ins, x, owned)
    check_ways(ways, random.Random(seed), n, k, me)
    shm.close()
    print(f"ok {n}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["refused"])
