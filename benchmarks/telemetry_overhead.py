"""What telemetry costs: actor calls and compiled training steps with it on and off, and ingest speed.

Run: `.venv/bin/python benchmarks/telemetry_overhead.py [--calls 100] [--steps 10] [--blocks 400]`.
Both settings run on one mesh, in pairs of blocks (off-on, then on-off): the recorders of the
controller and of every worker are switched between blocks, so drift in the machine's speed hits both
alike. Calls go to a one-process mesh whose worker is pinned to one core and the controller's thread
to another (with two cores or more), so the two never take turns on a core. Prints one table with the
"off" blocks as the baseline: the medians of each setting, and the median overhead of a pair with its
95% confidence interval. Many short pairs beat a few long blocks: this VM's speed drifts by ±30%.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import monarch
from monarch.actor import Actor, endpoint, this_host
from monarch.runtime.telemetry.events import BATCH, RECORDER, Events
from monarch.runtime.telemetry.store import Store


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


class Switch(Actor):
    """Turns the recorder of its worker process on or off; pins the process to a core."""

    @endpoint
    def set(self, on: bool) -> None:
        # not the module global: this class is pickled by value
        from monarch.runtime.telemetry import events as telemetry
        telemetry.RECORDER.on = on

    @endpoint
    def pin(self, cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})


def set_telemetry(switch: object, on: bool) -> None:
    RECORDER.on = on
    switch.set.call(on).get(timeout=30)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Paired:
    """Results of alternating blocks: per-block values with a setting off and on, pair by pair."""
    off: list[float]
    on: list[float]

    def overheads(self, rate: bool) -> list[float]:
        """Per pair, how much longer the work took with the setting on (rates: inverse ratio)."""
        return [(a / b if rate else b / a) - 1 for a, b in zip(self.off, self.on, strict=True)]


def paired(run: Callable[[], float], switch: Callable[[bool], None], blocks: int) -> Paired:
    """`run()` with a setting off and on (`switch(on)`), in pairs of blocks on the same mesh (off-on, then
    on-off); left on."""
    off, on = [], []
    for b in range(blocks):
        order = (False, True) if b % 2 == 0 else (True, False)
        for flag in order:
            switch(flag)
            (on if flag else off).append(run())
    switch(True)
    return Paired(off, on)


def pinned() -> bool:
    """Pin this thread to core 0 (the pinned mesh's worker takes core 1); False with one core."""
    if len(os.sched_getaffinity(0)) < 2:
        return False
    os.sched_setaffinity(0, {0})
    return True


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
    """Events/s from worker batches (as they arrive, BATCH rows each) to a query that counts them."""
    batches = [Events({"messages": [v for i in range(start, min(start + BATCH, n))
                                    for v in (i % 4, "echo", "ping", "controller", 100, i, i + 1, i + 2, "ok")]})
               for start in range(0, n, BATCH)]
    store = Store(retain=0)  # every row kept: this measures loading, not retention
    t = time.perf_counter()
    for batch in batches:
        store.add(batch, "mesh")
    assert store.sql("SELECT count(*) FROM messages") == [(n,)]
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=100, help="calls per block")
    p.add_argument("--steps", type=int, default=10, help="compiled steps per block")
    p.add_argument("--blocks", type=int, default=400, help="pairs of off/on blocks")
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    everywhere = os.sched_getaffinity(0)
    with this_host().spawn_procs(per_host={"x": 1}) as procs:
        switch = procs.spawn("switch", Switch)
        one = procs.spawn("echo", Echo).slice(x=0)
        pin = pinned()
        if pin:
            switch.pin.call(1).get(timeout=30)  # type: ignore[attr-defined]
        calls(one, 2000)
        call = paired(lambda: calls(one, a.calls), lambda on: set_telemetry(switch, on), a.blocks)
        os.sched_setaffinity(0, everywhere)
    with this_host().spawn_procs(per_host={"x": 2}) as procs:
        switch = procs.spawn("switch", Switch)
        one = procs.spawn("echo", Echo).slice(x=0)
        calls(one, 2000)
        shared = paired(lambda: calls(one, a.calls), lambda on: set_telemetry(switch, on), a.blocks)
        step = compiled_step(procs)
        for _ in range(5):
            step().item()
        steps = paired(lambda: steps_ms(step, a.steps), lambda on: set_telemetry(switch, on), a.blocks)
    table([(f"call_one throughput, 1 actor{' (pinned)' if pin else ''}", call, True, "{:,.0f} calls/s"),
           ("call_one, 1 actor of 2 procs (unpinned)", shared, True, "{:,.0f} calls/s"),
           ("compiled MLP step, 2 procs", steps, False, "{:.3f} ms")])
    print(f"ingest into DuckDB: {ingest_rate(1_000_000):,.0f} events/s (1,000,000 message rows)")


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median with its distribution-free 95% confidence interval (order statistics n/2 ± 0.98 sqrt(n))."""
    v, n = sorted(values), len(values)
    half = 0.98 * n ** 0.5
    return v[max(int(n / 2 - half), 0)], statistics.median(v), v[min(int(n / 2 + half), n - 1)]


def table(rows: list[tuple[str, Paired, bool, str]], setting: str = "telemetry") -> None:
    print(f"{'what':42}{setting + ' off':>15}{setting + ' on':>15}{'overhead':>10}{'95% interval':>18}")
    for what, result, rate, fmt in rows:
        low, median, high = median_interval(result.overheads(rate))
        print(f"{what:42}{fmt.format(statistics.median(result.off)):>15}{fmt.format(statistics.median(result.on)):>15}"
              f"{median * 100:>+9.1f}%{f'{low * 100:+.1f}% .. {high * 100:+.1f}%':>18}")


if __name__ == "__main__":
    main()
