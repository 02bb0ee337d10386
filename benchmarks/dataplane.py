"""Data-plane bandwidth of monarch against raw transports measured in the same run, by section.

collectives: a 64 MiB float32 all_reduce, all_gather and reduce_scatter between 2 and 4 ranks of this host,
each run as a MeshTensor redistribution (Partial->Replicate, Shard(0)->Replicate, Partial->Shard(0); only the
redistribution is timed, on warm workers, until `monarch.synchronize` returns) with MONARCH_TRANSPORT=auto
(shared memory here) and =mpi, and with MONARCH_COLLECTIVES=torch (gloo through torch.distributed); beside
them the same collectives on the same buffers with raw mpi4py (an mpiexec job, which also times monarch's
shared-memory transport on bare ranks), torch.distributed gloo under torchrun, and one process's memcpy of 64 MiB.
Medians of 5 (3 with --quick). Bus bandwidth follows NCCL-tests: all_reduce 2(n-1)/n * bytes/t, all_gather and
reduce_scatter (n-1)/n * bytes/t.

one-sided: RDMABuffer.read_into / write_from of 4 KiB, 1 MiB and 64 MiB between actors of two meshes of this
host, by cross-memory attach (shm), the owner's TCP door and MPI RMA windows (mpi: a pair joined on the
first transfer, outside the timing), against half an MPI Send/Recv round trip of the
same bytes (two ranks of an mpiexec job) and one process's memcpy; and an 8-byte read's latency against half an
MPI round trip and against an endpoint returning the 8 bytes. Medians of 5 warm runs (3 with --quick).

to_mesh: a 64 MiB tensor sharded over a 2-rank mesh moved to another 2-rank mesh (Shard(0) and Shard(1) on
arrival) with `t.to_mesh`, against fetching it to the controller and distributing it again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from monarch import MeshTensor, Placement
from monarch.actor import Actor, ActorMesh, endpoint
from monarch.rdma import RDMABuffer
from monarch.runtime.control.launch import MALLOC
from monarch.runtime.engine.transport import cma
from monarch.shape import MeshLike

sys.path.insert(0, str(Path(__file__).resolve().parent))
from actors import machine  # noqa: E402 - benchmarks import each other from this folder

MIB = 1 << 20
TIMEOUT = 300
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
BASELINES = ("raw mpi4py", "gloo (torchrun)")  # the raw transports monarch is compared with
FLAGS = (("MONARCH_TRANSPORT", "auto"), ("MONARCH_TRANSPORT", "mpi"), ("MONARCH_COLLECTIVES", "torch"))  # its rows


def busbw(kind: str, n: int, nbytes: int, seconds: float) -> float:
    """GB/s as NCCL-tests counts it: the bytes each rank's links carry, over the time."""
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / seconds / 1e9


def median_time(fn: Callable[[], None], reps: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(reps + 1):  # the first run warms up (segments, pages) and is not counted
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# -- monarch ---------------------------------------------------------------------------------------------

def monarch_times(n: int, nbytes: int, reps: int, flags: dict[str, str]) -> dict[str, float]:
    import torch

    import monarch
    from monarch import Partial, Replicate, Shard
    from monarch.actor import this_host

    env = {**flags, "MONARCH_HEARTBEAT_TIMEOUT": "60"}
    with this_host().spawn_procs(per_host={"x": n}, env=env) as procs:
        data = torch.ones(nbytes // 4)
        ways = {"all_reduce": ({"x": Partial()}, {"x": Replicate()}),
                "all_gather": ({"x": Shard(0)}, {"x": Replicate()}),
                "reduce_scatter": ({"x": Partial()}, {"x": Shard(0)})}
        out: dict[str, float] = {}
        for kind, (src, dst) in ways.items():
            out[kind] = redistribution_time(monarch.distribute_tensor(data, procs, src), dst, reps)
        return out


def redistribution_time(t: object, dst: dict, reps: int) -> float:
    """Median seconds of `t.redistribute(dst)` until the workers ran it (each result dropped before the next)."""
    import monarch
    procs = t.mesh
    monarch.synchronize(procs, timeout=TIMEOUT)
    held: list[object] = []

    def redistribute() -> None:
        held.append(t.redistribute(dst))
        monarch.synchronize(procs, timeout=TIMEOUT)
    return median_time(redistribute, reps, before=held.clear)


# -- raw transports (run as their own jobs) ---------------------------------------------------------------

def raw_mpi(nbytes: int, reps: int) -> None:
    """One rank of the mpiexec job: mpi4py on torch buffers, then monarch's shm transport on bare ranks."""
    import torch
    from mpi4py import MPI

    from monarch.program.instr import Comm
    from monarch.runtime.engine.transport.mpi import MpiTransport
    from monarch.runtime.engine.transport.shm import ShmTransport
    world = MPI.COMM_WORLD
    n, count = world.Get_size(), nbytes // 4
    full, piece = torch.ones(count), torch.ones(count // n)
    out: dict[str, dict[str, float]] = {"raw mpi4py": {}, "shm transport, bare ranks": {}}
    raw = {"all_reduce": lambda: world.Allreduce(MPI.IN_PLACE, full.numpy()),
           "all_gather": lambda: world.Allgather(piece.numpy(), full.numpy()),
           "reduce_scatter": lambda: world.Reduce_scatter_block(full.numpy(), piece.numpy())}
    for kind, fn in raw.items():
        out["raw mpi4py"][kind] = median_time(fn, reps, before=world.Barrier)
    ranks = tuple(range(n))
    shm = ShmTransport(lambda mdim: MpiTransport(lambda m: ranks).comm_for(ranks))
    comms = {"all_reduce": (Comm("all_reduce", 1, 2, 0, ((count,),) * n, torch.float32), full),
             "all_gather": (Comm("all_gather", 1, 2, 0, ((count // n,),) * n, torch.float32), piece),
             "reduce_scatter": (Comm("reduce_scatter", 1, 2, 0, ((count,),) * n, torch.float32), full)}
    for kind, (ins, x) in comms.items():
        out["shm transport, bare ranks"][kind] = median_time(lambda: shm(ins, x), reps, before=world.Barrier)
    shm.close()
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def raw_gloo(nbytes: int, reps: int) -> None:
    """One rank of the torchrun job: torch.distributed over gloo on the same buffers."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    n, count = dist.get_world_size(), nbytes // 4
    full, piece = torch.ones(count), torch.ones(count // n)
    ways = {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, piece),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(piece, full)}
    out: dict[str, float | None] = {}
    for kind, fn in ways.items():
        try:
            out[kind] = median_time(fn, reps, before=dist.barrier)
        except (RuntimeError, NotImplementedError):  # a collective this gloo build lacks
            out[kind] = None
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"gloo (torchrun)": out}), flush=True)
    dist.destroy_process_group()


def job(cmd: list[str], n: int) -> dict[str, dict[str, float | None]]:
    """Run a raw job with the workers' malloc settings (its transport calls allocate outputs as workers do)."""
    env = {**MALLOC, **os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def memcpy_time(nbytes: int, reps: int) -> float:
    import torch
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return median_time(lambda: dst.copy_(src), reps)


# -- the section -------------------------------------------------------------------------------------------

def collectives(args: argparse.Namespace) -> None:
    nbytes, reps = args.mib * MIB, 3 if args.quick else 5
    me = [sys.executable, str(Path(__file__).resolve()), "--mib", str(args.mib), "--reps", str(reps)]
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    copy = memcpy_time(nbytes, reps)
    print(f"memcpy {args.mib} MiB, one process: {copy * 1e3:.1f} ms, {nbytes / copy / 1e9:.2f} GB/s\n")
    rows, goals = [], []
    for n in args.ranks:
        ways = {f"monarch, {k}={v}": monarch_times(n, nbytes, reps, {k: v}) for k, v in FLAGS}
        ways.update(job([mpiexec, "-n", str(n), *me, "--worker", "mpi"], n))
        ways.update(job([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                         *me[1:], "--worker", "gloo"], n))
        for kind in KINDS:
            bw = {w: busbw(kind, n, nbytes, t[kind]) if t.get(kind) else None for w, t in ways.items()}
            best = max((bw[b] for b in BASELINES if bw.get(b)), default=None)
            for w, t in ways.items():
                gloo = bw[w] / bw["gloo (torchrun)"] if bw[w] and bw["gloo (torchrun)"] else None
                rows.append((kind, str(n), w, f"{t[kind] * 1e3:.1f} ms" if t.get(kind) else "n/a",
                             f"{bw[w]:.2f} GB/s" if bw[w] else "n/a", f"{gloo:.2f}x" if gloo else "-",
                             f"{bw[w] / best:.2f}x" if bw[w] and best else "-"))
            mine, gloo_bw = bw["monarch, MONARCH_TRANSPORT=auto"], bw["gloo (torchrun)"]
            if n == 2 and mine and gloo_bw and best:
                goals += [(f"{kind}, 2 ranks, busbw x gloo", mine / gloo_bw, 2.0 if kind == "all_reduce" else 3.0),
                          (f"{kind}, 2 ranks, busbw x the best raw transport", mine / best, 1 / 1.2)]
    grid(("collective", "ranks", "way", "time", "busbw", "vs gloo", "vs best raw"), rows)
    print()
    for goal, value, bar in goals:
        print(f"goal: {goal}: {value:.2f} (goal >= {bar:.2f}): {'met' if value >= bar else 'NOT met'}")


# -- one-sided -----------------------------------------------------------------------------------------------

ONESIDED_SIZES = (4 << 10, MIB, 64 * MIB)
LATENCY_BATCH = 100  # 8-byte transfers per timed batch


class Peer(Actor):
    """Holds a buffer of each size measured and times one-sided transfers with another peer's."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    @endpoint
    def share(self, nbytes: int) -> RDMABuffer:
        self.kept[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
        return RDMABuffer(self.kept[nbytes])

    @endpoint
    def blob(self, nbytes: int) -> torch.Tensor:
        return self.kept[nbytes]

    @endpoint
    def transfers(self, buf: RDMABuffer, backend: str, reps: int) -> dict[str, float]:
        """Median seconds of one read_into and one write_from of all of `buf` (per transfer for 8 bytes), and
        of this process's memcpy of as many bytes right after, by torch on as many threads as a transfer of that
        size copies with (cma.parts: one below 16 MiB)."""
        os.environ["MONARCH_RDMA_BACKEND"] = backend
        local = torch.empty(buf.size(), dtype=torch.uint8)
        batch = LATENCY_BATCH if buf.size() <= 8 else 1
        out = {"read_into": median_time(lambda: [buf.read_into(local).get() for _ in range(batch)], reps),
               "write_from": median_time(lambda: [buf.write_from(local).get() for _ in range(batch)], reps)}
        torch.set_num_threads(len(cma.parts(buf.size())))
        return {**{k: t / batch for k, t in out.items()}, "memcpy": memcpy_time(buf.size(), reps)}

    @endpoint
    def endpoint_return(self, other: ActorMesh, nbytes: int, reps: int) -> float:
        """Median seconds of `other.blob.call_one(nbytes)`: the bytes returned by an endpoint instead."""
        batch = LATENCY_BATCH // 10
        return median_time(lambda: [other.blob.call_one(nbytes).get() for _ in range(batch)], reps) / batch


def raw_pingpong(sizes: list[int], reps: int) -> None:
    """One of two ranks of the mpiexec job: half a Send/Recv round trip of each size (8 bytes in batches)."""
    import numpy
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, out = world.Get_rank(), {}
    for nbytes in sizes:
        buf, batch = numpy.ones(nbytes, dtype=numpy.uint8), LATENCY_BATCH if nbytes <= 8 else 1

        def round_trips() -> None:
            for _ in range(batch):
                if rank == 0:
                    world.Send(buf, dest=1)
                    world.Recv(buf, source=1)
                else:
                    world.Recv(buf, source=0)
                    world.Send(buf, dest=0)
        out[str(nbytes)] = median_time(round_trips, reps, before=world.Barrier) / batch / 2
    if rank == 0:
        print("RESULT " + json.dumps({"mpi": out}), flush=True)


def onesided(args: argparse.Namespace) -> None:
    from monarch.actor import this_host
    reps = 3 if args.quick else 5
    sizes = [8, *ONESIDED_SIZES]
    me = [sys.executable, str(Path(__file__).resolve()), "--reps", str(reps), "--worker", "pingpong"]
    mpi = job([str(Path(sys.executable).with_name("mpiexec")), "-n", "2", *me], 2)["mpi"]
    env = {"MONARCH_HEARTBEAT_TIMEOUT": "60"}
    meshes = [this_host().spawn_procs(per_host={"x": 1}, env=env) for _ in range(2)]
    with meshes[0] as a, meshes[1] as b:
        owner, reader = a.spawn("owner", Peer), b.spawn("reader", Peer)
        bufs = {n: owner.share.call_one(n).get(timeout=TIMEOUT) for n in sizes}
        ways = {be: {n: reader.transfers.call_one(bufs[n], be, reps).get(timeout=TIMEOUT) for n in sizes}
                for be in ("shm", "tcp", "mpi")}
        endpoint_s = reader.endpoint_return.call_one(owner, 8, reps).get(timeout=TIMEOUT)
    rows, copies = [], {n: statistics.median(ways[be][n]["memcpy"] for be in ways) for n in ONESIDED_SIZES}
    for n in ONESIDED_SIZES:
        copy, send = copies[n], mpi[str(n)]
        cells = [(f"{op}, {be}", ways[be][n][op]) for be in ways for op in ("read_into", "write_from")]
        for way, t in [*cells, ("MPI Send/Recv (half round trip)", send), ("memcpy (torch copy_, same threads)", copy)]:
            rows.append((size_name(n), way, f"{t * 1e3:.3f} ms", f"{n / t / 1e9:.2f} GB/s", f"{copy / t:.2f}x",
                         f"{send / t:.2f}x"))
    grid(("size", "way", "time", "bandwidth", "vs memcpy", "vs MPI"), rows)
    half = mpi["8"]
    lat = [(f"read_into, {be}", ways[be][8]["read_into"]) for be in ways] + [
        ("MPI Send/Recv, half round trip", half), ("endpoint returning the 8 bytes (call_one)", endpoint_s)]
    print()
    grid(("8 bytes", "latency", "vs MPI half round trip", "vs endpoint"),
         [(w, f"{t * 1e6:.1f} us", f"{t / half:.2f}x", f"{endpoint_s / t:.1f}x faster") for w, t in lat])
    big, shm, tcp = 64 * MIB, ways["shm"], ways["tcp"]
    goals = [("shm read_into of 64 MiB, x memcpy", copies[big] / shm[big]["read_into"], ">=", 0.8),
             ("8-byte shm read_into, x half an MPI round trip", shm[8]["read_into"] / half, "<=", 2.0),
             ("8-byte shm read_into, times faster than an endpoint", endpoint_s / shm[8]["read_into"], ">=", 5.0),
             ("TCP read_into of 64 MiB, GB/s", big / tcp[big]["read_into"] / 1e9, ">=", 2.0)]
    print()
    for goal, value, sense, bar in goals:
        met = value >= bar if sense == ">=" else value <= bar
        print(f"goal: {goal}: {value:.2f} (goal {sense} {bar:g}): {'met' if met else 'NOT met'}")


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MIB else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def grid(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for i, r in enumerate([head, *rows]):
        print("  ".join(v.ljust(w) if j < 2 else v.rjust(w) for j, (v, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def to_mesh(args: argparse.Namespace) -> None:
    import monarch
    from monarch import Shard
    from monarch.actor import this_host
    reps, nbytes = (3 if args.quick else 5), args.mib * MIB
    env = {"MONARCH_HEARTBEAT_TIMEOUT": "60"}
    with this_host().spawn_procs(per_host={"x": 2}, env=env) as a, \
            this_host().spawn_procs(per_host={"y": 2}, env=env) as b:
        t = monarch.randn(nbytes // 4 // 1024, 1024, mesh=a, placements={"x": Shard(0)})
        monarch.synchronize(a, TIMEOUT)
        rows = []
        for target in (Shard(0), Shard(1)):
            held: list[object] = []
            direct = median_time(lambda: held.append(t.to_mesh(b, {"y": target})), reps, held.clear)
            routed = median_time(lambda: held.append(_routed(t, b, target)), reps, held.clear)
            ways = ((f"to_mesh, S(0) -> {target!r}", direct), (f"full_tensor + distribute, -> {target!r}", routed))
            for way, s in ways:
                rows.append((size_name(nbytes), way, f"{s * 1e3:.1f} ms", f"{nbytes / s / 1e9:.2f} GB/s",
                             f"{routed / s:.2f}x"))
    grid(("size", "way (2 ranks -> 2 ranks)", "time", "bandwidth", "vs through the controller"), rows)


def _routed(t: MeshTensor, mesh: MeshLike, target: Placement) -> MeshTensor:
    """The way without to_mesh: the whole tensor to the controller, then each piece to its rank."""
    import monarch
    moved = monarch.distribute_tensor(t.full_tensor(timeout=TIMEOUT), mesh, {"y": target})
    monarch.synchronize(mesh, TIMEOUT)
    return moved


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "collectives": collectives, "one-sided": onesided, "to_mesh": to_mesh}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test, not for numbers)")
    p.add_argument("--mib", type=int, default=64, help="collective size in MiB")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["mpi", "gloo", "pingpong"], help=argparse.SUPPRESS)  # one rank of a raw job
    args = p.parse_args()
    if args.worker == "pingpong":
        raw_pingpong([8, *ONESIDED_SIZES], args.reps)
        return
    if args.worker:
        (raw_mpi if args.worker == "mpi" else raw_gloo)(args.mib * MIB, args.reps)
        return
    print(f"monarch dataplane, {datetime.date.today().isoformat()}, {'quick' if args.quick else 'full'} run")
    print(machine())
    for name in args.only or list(SECTIONS):
        print(f"\n== {name} ==")
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
