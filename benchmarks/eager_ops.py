"""Eager sharded ops: per-op cost of a long chain of small ops against local torch and DTensor, and a matmul.

Run: `.venv/bin/python benchmarks/eager_ops.py [--ops 1000] [--procs 4] [--reps 5]`. Prints one table with
the baselines measured in the same run (DTensor: this file again under `torch.distributed.run`, gloo, one
torch thread per rank, as many ranks as monarch has procs), and the machine it ran on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import monarch
from monarch import Shard
from monarch.actor import this_host
from monarch.graph.partition import FREE_BATCH, partition
from monarch.runtime.session.lower import lower
from monarch.runtime.session.session import session_of

OPS: list[Callable[[torch.Tensor], torch.Tensor]] = [
    lambda t: t + 1.0, lambda t: t * 0.5, torch.relu, torch.neg, torch.sigmoid, torch.tanh,
]


def chain(t: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):
        t = OPS[i % len(OPS)](t)
    return t


def median_us(fn: Callable[[], object], reps: int, per: int = 1) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / per * 1e6)
    return statistics.median(times)


def dtensor_rank(ops: int, reps: int) -> None:
    """One rank of the DTensor job: the chain on a DTensor sharded Shard(0), from the first op to
    `full_tensor()`; rank 0 prints the slowest rank's median µs per op."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard, distribute_tensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        base = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        x = distribute_tensor(base, init_device_mesh("cpu", (dist.get_world_size(),)), [DShard(0)])
        assert torch.allclose(chain(x, ops).full_tensor(), chain(base, ops), atol=1e-5), "DTensor chain differs"

        def once() -> float:
            dist.barrier()
            return median_us(lambda: chain(x, ops).full_tensor(), 1, ops)
        slowest = torch.tensor([statistics.median(once() for _ in range(reps))])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(slowest.item()), flush=True)
    finally:
        dist.destroy_process_group()


def dtensor_us(procs: int, ops: int, reps: int) -> float:
    """DTensor's µs per op on the chain, over `procs` ranks under torch.distributed.run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           __file__, "--dtensor-rank", "--ops", str(ops), "--reps", str(reps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(json.loads(lines[-1][len("RESULT "):]))


def controller_cost(x: monarch.MeshTensor, n: int) -> tuple[float, float]:
    """(record + propagate, partition + lower) in µs per op; the recorded graph is then run for real."""
    s = session_of(x.mesh)
    t0 = time.perf_counter()
    y = chain(x, n)
    t1 = time.perf_counter()
    traced = s.tracer.take()
    programs = partition(traced, FREE_BATCH)
    lower(programs, s.view)
    t2 = time.perf_counter()
    s.ship(traced, programs)
    y.full_tensor(timeout=60)
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--matmul", type=int, default=2048)
    p.add_argument("--dtensor-rank", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.dtensor_rank:
        return dtensor_rank(a.ops, a.reps)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}, {sys.platform}")
    rows: list[tuple[str, str, str]] = []
    dtensor = dtensor_us(a.procs, a.ops, a.reps)  # before monarch's workers start: they do not share the cores
    with this_host().spawn_procs(per_host={"x": a.procs}) as procs:
        base = torch.randn(64, 64)
        x = monarch.distribute_tensor(base, procs, {"x": Shard(0)})
        chain(x, 50).full_tensor(timeout=60)  # warm up: workers import torch, caches fill
        local = median_us(lambda: chain(base, a.ops), a.reps, a.ops)
        e2e = median_us(lambda: chain(x, a.ops).full_tensor(timeout=60), a.reps, a.ops)
        costs = [controller_cost(x, a.ops) for _ in range(a.reps)]
        record = statistics.median(c[0] for c in costs)
        compile_ = statistics.median(c[1] for c in costs)
        got, want = chain(x, a.ops).full_tensor(timeout=60), chain(base, a.ops)
        assert torch.allclose(got, want, atol=1e-5), "sharded chain differs from local torch"
        rows += [
            (f"chain of {a.ops} ops, 64x64, local torch", f"{local:.1f} us/op", "baseline"),
            (f"same chain, DTensor S(0) over {a.procs} ranks", f"{dtensor:.1f} us/op", "baseline"),
            (f"same chain, S(0) over {a.procs} procs, end to end", f"{e2e:.1f} us/op", f"{e2e / local:.1f}x local"),
            ("  monarch / DTensor", "", f"{e2e / dtensor:.2f}x (aim <= 0.5)"),
            ("  controller: record + propagate", f"{record:.1f} us/op", ""),
            ("  controller: partition + lower", f"{compile_:.1f} us/op", ""),
            ("  controller total", f"{record + compile_:.1f} us/op", "aim <= 30"),
        ]
        rows += matmul_rows(procs, a.matmul, a.reps)
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'what':<{width}}{'time':>16}  {'ratio':>14}")
    for what, t, ratio in rows:
        print(f"{what:<{width}}{t:>16}  {ratio:>14}")


def matmul_rows(procs: object, n: int, reps: int) -> list[tuple[str, str, str]]:
    a, b = torch.randn(n, n), torch.randn(n, n)
    local = median_us(lambda: a @ b, reps) / 1e3
    x = monarch.distribute_tensor(a, procs, {"x": Shard(0)})
    w = monarch.distribute_tensor(b, procs)
    monarch.synchronize(procs, timeout=120)
    sharded = median_us(lambda: (x @ w, monarch.synchronize(procs, timeout=120)), reps) / 1e3
    fetched = median_us(lambda: (x @ w).full_tensor(timeout=120), reps) / 1e3
    assert torch.allclose((x @ w).full_tensor(timeout=120), a @ b, rtol=1e-4, atol=1e-3)
    return [
        (f"matmul {n}x{n}, local torch", f"{local:.1f} ms", "baseline"),
        (f"matmul {n}x{n}, S(0) x R on {len(procs)} procs",  # type: ignore[arg-type]
         f"{sharded:.1f} ms", f"{local / sharded:.2f}x speed"),
        ("  same, result fetched to the controller", f"{fetched:.1f} ms", f"{local / fetched:.2f}x speed"),
    ]


if __name__ == "__main__":
    main()
