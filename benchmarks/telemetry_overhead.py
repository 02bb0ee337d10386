"""What telemetry costs: actor calls and compiled training steps with it on and off, and ingest speed.

Run: `.venv/bin/python benchmarks/telemetry_overhead.py [--calls 1000] [--steps 50] [--blocks 9]`. Both
settings run on one mesh, in alternating blocks: the recorders of the controller and of every worker
are switched between blocks, so drift in the machine's speed hits both alike. Prints one table with
the "off" blocks as the baseline (medians).
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


class Switch(Actor):
    """Turns the recorder of its worker process on or off."""

    @endpoint
    def set(self, on: bool) -> None:
        RECORDER.on = on


def set_telemetry(switch: object, on: bool) -> None:
    RECORDER.on = on
    switch.set.call(on).get(timeout=30)  # type: ignore[attr-defined]


def interleaved(run: Callable[[], float], switch: object, blocks: int) -> tuple[float, float]:
    """Median of `run()` with telemetry off and on, in alternating blocks on the same mesh."""
    off, on = [], []
    for _ in range(blocks):
        for flag, out in ((False, off), (True, on)):
            set_telemetry(switch, flag)
            out.append(run())
    set_telemetry(switch, True)
    return statistics.median(off), statistics.median(on)


def calls(one: object, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        one.ping.call_one(i).get(timeout=30)  # type: ignore[attr-defined]
    return n / (time.perf_counter() - t)


def compiled_step(procs: object) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(monarch.distribute_tensor(torch.randn(64, 256), procs))
    w2 = torch.nn.Parameter(monarch.distribute_tensor(torch.randn(256, 64), procs))
    opt = torch.optim.AdamW([w1, w2], lr=1e-3)
    x, y = torch.randn(64, 64), torch.randn(64, 64)

    @monarch.compile
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return lambda: step(x, y)


def steps_ms(step: Callable[[], torch.Tensor], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        loss = step()
    loss.item()
    return (time.perf_counter() - t) / n * 1e3


def ingest_rate(n: int) -> float:
    rows = [(i % 4, "echo", "ping", 100, i, i + 1, i + 2, "ok") for i in range(n)]
    store = Store()
    store.add(Events({"messages": rows}))
    t = time.perf_counter()
    assert store.sql("SELECT count(*) FROM messages") == [(n,)]
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=1000, help="calls per block")
    p.add_argument("--steps", type=int, default=50, help="compiled steps per block")
    p.add_argument("--blocks", type=int, default=9, help="alternating off/on blocks; medians are reported")
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    with this_host().spawn_procs(per_host={"x": 2}) as procs:
        switch = procs.spawn("switch", Switch)
        one = procs.spawn("echo", Echo).slice(x=0)
        calls(one, 500)
        call_off, call_on = interleaved(lambda: calls(one, a.calls), switch, a.blocks)
        step = compiled_step(procs)
        for _ in range(5):
            step().item()
        step_off, step_on = interleaved(lambda: steps_ms(step, a.steps), switch, a.blocks)
    rows = [
        ("call_one throughput, 1 actor", f"{call_off:,.0f} calls/s", f"{call_on:,.0f} calls/s",
         f"{(call_off / call_on - 1) * 100:+.1f}%"),
        ("compiled MLP step, 2 procs", f"{step_off:.3f} ms", f"{step_on:.3f} ms",
         f"{(step_on / step_off - 1) * 100:+.1f}%"),
    ]
    print(f"{'what':32}{'telemetry off':>18}{'telemetry on':>18}{'overhead':>12}")
    for what, off, on, overhead in rows:
        print(f"{what:32}{off:>18}{on:>18}{overhead:>12}")
    print(f"ingest into DuckDB: {ingest_rate(1_000_000):,.0f} events/s (1,000,000 message rows)")


if __name__ == "__main__":
    main()
