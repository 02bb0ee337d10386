"""Run under `mpiexec -n K`: random collectives (transport_check.case: every kind, dtype and op, uneven, strided,
conjugate and multi-megabyte pieces) through the torch.distributed (gloo) transport and the MPI one, checked
against each other and against plain torch; reductions gloo lacks (int16, a complex product) equal MPI's; what
MONARCH_COLLECTIVES picks by device; with 4 ranks, the row and column groups of a 2x2 mesh are first made in
opposite orders on the two rows. Prints one line per rank ("ok N" or the failure).
"""
from __future__ import annotations

import random
import sys
from collections.abc import Callable

import torch
from mpi4py import MPI
from transport_check import check_ways, way_of

from monarch.program.instr import Comm, Start
from monarch.runtime.engine.service import Transports, nccl_usable
from monarch.runtime.engine.transport.mpi import MpiTransport
from monarch.runtime.engine.transport.shm import shares_memory
from monarch.runtime.engine.transport.torchdist import Rendezvous, TorchTransport


def groups(k: int, me: int) -> dict[int, tuple[int, ...]]:
    """mdim 0: every rank; with 4 ranks, mdim 1: this rank's column of a 2x2 mesh, mdim 2: its row."""
    out = {0: tuple(range(k))}
    if k == 4:
        out |= {1: (me % 2, me % 2 + 2), 2: (me // 2 * 2, me // 2 * 2 + 1)}
    return out


def crossed_groups(torch_t: TorchTransport, k: int, me: int) -> None:
    """The top row makes its row group, then its columns; the bottom row its columns, then its row."""
    if k != 4:
        return
    for mdim in ((2, 1) if me < 2 else (1, 2)):
        ins = Comm("all_reduce", 1, 2, mdim, ((2,),) * 2, torch.float32)
        out = torch_t(ins, torch.full((2,), float(me)), False)
        want = sum(groups(k, me)[mdim])
        assert torch.equal(out, torch.full((2,), float(want))), f"mdim {mdim}: {out} != {want}"


def unnative(mpi: MpiTransport, torch_t: TorchTransport, k: int, me: int) -> None:
    """Reductions gloo has no kernel for, gathered and reduced locally: equal to MPI's."""
    g = torch.Generator().manual_seed(me)
    for dtype in (torch.int16, torch.complex128):
        x = torch.randint(-3, 4, (k + 1, 3), generator=g).to(dtype) + (1j if dtype.is_complex else 0)
        for ins in (Comm("all_reduce", 1, 2, 0, ((k + 1, 3),) * k, dtype, op="prod"),
                    Comm("reduce_scatter", 1, 2, 0, ((k + 1, 3),) * k, dtype, op="prod"),
                    Start((1,), (2,), 0, "prod", dtype, ((k + 1, 3),))):
            if isinstance(ins, Start):
                a, b = mpi.start(ins, x.reshape(-1).clone())(), torch_t.start(ins, x.reshape(-1).clone())()
            else:
                a, b = mpi(ins, x, False), torch_t(ins, x, False)
            torch.testing.assert_close(b, a, rtol=1e-12, atol=0, msg=lambda m: f"{ins!r}: {m}")


def choices(group_of: Callable[[int], tuple[int, ...]]) -> None:
    """What each MONARCH_COLLECTIVES picks for CPU and CUDA tensors: CUDA ones on NCCL when asked for by name
    or where it can run them, else staged through host memory over the CPU choice."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    ways = {c: Transports(group_of, "auto", c) for c in ("auto", "mpi", "torch")}
    assert [ways[c].pick(0, cpu).name(0) for c in ways] == ["shm", "shm", "torch-gloo"]
    assert ways["torch"].pick(0, cuda).name(0) == "torch-nccl"
    assert ways["mpi"].pick(0, cuda).name(0) == "shm (staged from cuda)"
    assert ways["auto"].pick(0, cuda).name(0) == ("torch-nccl" if nccl_usable() else "shm (staged from cuda)")


def main(seed: int, n: int) -> None:
    world = MPI.COMM_WORLD
    k, me = world.Get_size(), world.Get_rank()
    group_of = groups(k, me).__getitem__
    mpi = MpiTransport(group_of)
    torch_t = TorchTransport(group_of, Rendezvous(mpi.comm_for, lambda ranks: shares_memory(mpi.comm_for(ranks))),
                             "gloo")
    choices(group_of)
    crossed_groups(torch_t, k, me)
    unnative(mpi, torch_t, k, me)
    check_ways({"mpi": way_of(mpi), "torch": way_of(torch_t)}, random.Random(seed), n, k, me)
    print(f"ok {n}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
