"""What telemetry costs: actor calls and compiled training steps with it on and off, and ingest speed.

Run: `.venv/bin/python benchmarks/telemetry_overhead.py [--calls 5000] [--steps 200]`. Both settings run
in this one process: the controller's recorder is switched, and each setting gets its own mesh whose
workers start with MONARCH_TELEMETRY=1 or 0. Prints one table with the "off" runs as the baseline.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import monarch
from monarch.actor import Actor, endpoint, this_host
from monarch.runtime.telemetry import RECORDER, Events
from monarch.runtime.telemetry_db import Store


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


def calls_per_s(procs: object, n: int) -> float:
    one = procs.spawn("echo", Echo).slice(x=0)  # type: ignore[attr-defined]
    for i in range(200):
        one.ping.call_one(i).get(timeout=30)
    t = time.perf_counter()
    for i in range(n):
        one.ping.call_one(i).get(timeout=30)
    return n / (time.perf_counter() - t)


def step_ms(procs: object, steps: int) -> float:
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(monarch.distribute_tensor(torch.randn(64, 256), procs))
    w2 = torch.nn.Parameter(monarch.distribute_tensor(torch.randn(256, 64), procs))
    opt = torch.optim.AdamW([w1, w2], lr=1e-3)

    @monarch.compile
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(64, 64), torch.randn(64, 64)
    for _ in range(5):
        step(x, y).item()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    loss.item()
    return (time.perf_counter() - t) / steps * 1e3


def measure(on: bool, calls: int, steps: int) -> tuple[float, float]:
    RECORDER.on = on
    env = {"MONARCH_TELEMETRY": "1" if on else "0"}
    with this_host().spawn_procs(per_host={"x": 2}, env=env) as procs:
        return calls_per_s(procs, calls), step_ms(procs, steps)


def ingest_rate(n: int) -> float:
    rows = [(i % 4, "echo", "ping", 100, i, i + 1, i + 2, "ok") for i in range(n)]
    store = Store()
    store.add(Events({"messages": rows}))
    t = time.perf_counter()
    assert store.sql("SELECT count(*) FROM messages") == [(n,)]
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds; medians are reported")
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(a.rounds):
        for on in (False, True):
            results[on].append(measure(on, a.calls, a.steps))
    RECORDER.on = True
    med: Callable[[bool, int], float] = lambda on, k: statistics.median(r[k] for r in results[on])
    rows = [
        ("call_one throughput, 1 actor", f"{med(False, 0):,.0f} calls/s", f"{med(True, 0):,.0f} calls/s",
         f"{(1 - med(True, 0) / med(False, 0)) * 100:+.1f}% slower"),
        ("compiled MLP step, dp=2 (x=2)", f"{med(False, 1):.2f} ms", f"{med(True, 1):.2f} ms",
         f"{(med(True, 1) / med(False, 1) - 1) * 100:+.1f}% slower"),
    ]
    print(f"{'what':32}{'telemetry off':>18}{'telemetry on':>18}{'overhead':>16}")
    for what, off, on, overhead in rows:
        print(f"{what:32}{off:>18}{on:>18}{overhead:>16}")
    print(f"ingest into DuckDB: {ingest_rate(1_000_000):,.0f} events/s (1,000,000 message rows)")


if __name__ == "__main__":
    main()
