"""What heartbeats cost (call_one round trip, compiled training step) and how fast they find a stopped worker.

Run: `.venv/bin/python benchmarks/heartbeat.py [--calls 100] [--steps 10] [--blocks 400] [--stops 3]`.
Costs: the paired blocks of telemetry_overhead.py (off-on, then on-off, on one mesh), switching the
mesh's heartbeats between blocks: the controller stops (or resumes) checking it and its workers stop (or
resume) beating. Round trips go to a one-process mesh whose worker's main thread is pinned to one core
and the controller's thread to another. What runs in both settings (a timer check per poll, a flag set
per socket read, the worker's send lock) is timed apart. Detection: SIGSTOP one worker of a 2-process
mesh while a call to it is pending; seconds until that call raises SupervisionError, median of fresh
meshes, against MONARCH_HEARTBEAT_TIMEOUT (of this process: `MONARCH_HEARTBEAT_TIMEOUT=2 ...` to shorten).
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

from actors import Echo, machine, signal_detection
from telemetry_overhead import Switch, calls, compiled_step, paired, pinned, steps_ms, table

from monarch import config
from monarch.actor import ProcMesh, this_host
from monarch.runtime.control import codec
from monarch.runtime.control.commands import Heartbeat
from monarch.runtime.control.controller import controller
from monarch.runtime.control.heartbeat import Watch, interval

TIMEOUT = 60.0  # seconds any single wait may take before the benchmark fails


def switch_heartbeats(procs: ProcMesh, timeout: float) -> Callable[[bool], None]:
    """`switch(on)` for `paired`: the mesh's heartbeats on (with `timeout`) or off, on both ends."""
    mesh = procs._mesh  # type: ignore[attr-defined]

    def switch(on: bool) -> None:
        mesh.heartbeat = timeout if on else 0.0
        controller().fan_out(mesh, mesh.shape, codec.encode_frame([Heartbeat(interval(timeout) if on else 0.0)]))
    return switch


def round_trip_us(one: object, n: int) -> float:
    return 1e6 / calls(one, n)


def bookkeeping_us(n: int = 500_000) -> float:
    """µs per call_one of what runs in both settings: the controller's timer check (one poll per call)
    and the flag its socket read sets; the worker's send lock and the flag it sets."""
    watch, lock, meshes, now, flags = Watch(), threading.Lock(), {}, time.monotonic(), SimpleNamespace()
    fail = print  # never called: there is no mesh to fail
    t = time.perf_counter()
    for _ in range(n):
        watch.tick(now, meshes, fail)
        flags.fresh = True
        lock.acquire()
        flags.sent = True
        lock.release()
    return (time.perf_counter() - t) / n * 1e6


def print_machine() -> None:
    print(f"monarch heartbeat benchmark, {datetime.date.today().isoformat()}")
    print(machine(f"MONARCH_HEARTBEAT_TIMEOUT={config.heartbeat_timeout():g}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=100, help="calls per block")
    p.add_argument("--steps", type=int, default=10, help="compiled steps per block")
    p.add_argument("--blocks", type=int, default=400, help="pairs of off/on blocks")
    p.add_argument("--stops", type=int, default=3, help="fresh meshes whose worker is stopped")
    a = p.parse_args()
    timeout = config.heartbeat_timeout()
    if timeout <= 0:
        raise SystemExit("MONARCH_HEARTBEAT_TIMEOUT=0 turns heartbeats off: nothing to measure")
    print_machine()
    everywhere = os.sched_getaffinity(0)
    with this_host().spawn_procs(per_host={"x": 1}) as procs:
        one = procs.spawn("echo", Echo).slice(x=0)
        pin = pinned()
        if pin:
            procs.spawn("switch", Switch).pin.call(1).get(timeout=TIMEOUT)  # type: ignore[attr-defined]
        round_trip_us(one, 2000)
        call = paired(lambda: round_trip_us(one, a.calls), switch_heartbeats(procs, timeout), a.blocks)
        os.sched_setaffinity(0, everywhere)
    with this_host().spawn_procs(per_host={"x": 2}) as procs:
        step = compiled_step(procs)
        for _ in range(5):
            step().item()
        steps = paired(lambda: steps_ms(step, a.steps), switch_heartbeats(procs, timeout), a.blocks)
    table([(f"call_one round trip, 1 actor{' (pinned)' if pin else ''}", call, False, "{:.2f} µs"),
           ("compiled MLP step, 2 procs", steps, False, "{:.3f} ms")], setting="heartbeats")
    both = bookkeeping_us()
    print(f"in both settings, per call_one: {both:.3f} µs = {both / statistics.median(call.off) * 100:.2f}% of "
          "the round trip (a poll's timer check, a read's flag, the worker's send lock)")
    stops = [signal_detection(signal.SIGSTOP, TIMEOUT) for _ in range(a.stops)]
    print(f"SIGSTOP to SupervisionError on a pending call: median {statistics.median(stops):.2f} s "
          f"(runs {', '.join(f'{s:.2f}' for s in stops)}), {statistics.median(stops) / timeout:.2f}x "
          f"MONARCH_HEARTBEAT_TIMEOUT={timeout:g} s")


if __name__ == "__main__":
    main()
