"""Eager sharded ops: per-op cost of a long chain of small ops, and a large matmul, against local torch.

Run: `.venv/bin/python benchmarks/eager_ops.py [--ops 1000] [--procs 4] [--reps 5]`. Prints one table
with the local-torch baseline measured in the same run, and the machine it ran on.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import monarch
from monarch import Shard
from monarch.actor import this_host
from monarch.graph.partition import partition
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


def controller_cost(x: monarch.MeshTensor, n: int) -> tuple[float, float]:
    """(record + propagate, partition + lower) in µs per op; the recorded graph is then run for real."""
    s = session_of(x.mesh)
    t0 = time.perf_counter()
    y = chain(x, n)
    t1 = time.perf_counter()
    traced = s.tracer.take()
    programs = partition(traced)
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
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}, {sys.platform}")
    rows: list[tuple[str, str, str]] = []
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
            (f"same chain, S(0) over {a.procs} procs, end to end", f"{e2e:.1f} us/op", f"{e2e / local:.1f}x local"),
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
