"""Actor-call latency and throughput of monarch, against raw-socket floors measured in the same run.

Numbers (all round trips timed on the controller with time.perf_counter):
- floor, blocking: a 100-byte (--payload) ping-pong over loopback TCP (TCP_NODELAY) with a forked echo
  process, both ends in a blocking recv and pinned to two different cores. The least any request/reply
  through the kernel can cost here when the receiver sleeps.
- floor, spin: the same, but both ends first busy-poll `recv(..., MSG_DONTWAIT)` for up to MONARCH_SPIN_US
  (default 50 µs) before blocking, as monarch's control plane does; it skips the idle CPU's wake-up.
- floor, Pipe: a stdlib `multiprocessing.Pipe` echo (`send_bytes`/`recv_bytes`) with a forked process, neither
  end pinned nor spinning: what a plain Python request/reply between two processes costs here.
- call_one: p50/p99 of `call_one(payload).get()` on one actor; ratio = p50 (p99) over each floor's p50 (p99).
- call_one, N workers: the same against the Pipe floor, on the dp=2 x tp=2 mesh (4 workers) and on fresh meshes
  of 1 and 2, the other workers idle (the goal: at most 2x; idle workers must not take the core the called one
  needs).
- call, 4 procs: `call(payload).get()` on a dp=2 x tp=2 mesh (fan out 4, gather 4); ratio over call_one.
- broadcast: messages delivered per second (calls x actors) for N `broadcast` calls then one waiting call
  (FIFO per sender makes it a barrier); 1 actor against the sequential call_one rate (1 / call_one p50),
  4 actors against the 1-actor rate.
- spawn: `spawn_procs(per_host={"procs": N})` + `spawn` until the first `call` answers, N = 2 and 4, median of
  fresh meshes (startup.py, each stopped afterwards, stop not timed), against Meta's Monarch (torchmonarch) timed
  by the same code in a subprocess of its interpreter (--monarch-python); 4 bare Python interpreters at once.
- first tensor op: from `spawn_procs` of 2 procs until `torch.ones(4).sum().item()` on them returned, the
  workers importing torch on their first program (MONARCH_PRELOAD_TORCH=off) or from their start (on).
- stop: `procs.stop().get()` of a 4-proc mesh whose workers imported torch (a tensor op ran), median of
  fresh meshes, against the 0.3 s target and against the spawn of such a mesh.
- kill -9: SIGKILL one worker of a 2-proc mesh while a call is pending; time until the caller's
  `get()` raises SupervisionError (which names the rank and the signal), against the 1 s target.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import monarch.actor
from monarch import config
from monarch.actor import Actor, ActorMesh, Future, ProcMesh, SupervisionError, endpoint, this_host
from startup import bare_interpreters, first_tensor_op, meta_python, meta_spawn_times, meta_version, spawn_times

TIMEOUT = 60.0  # seconds any single wait may take before the benchmark fails


class Echo(Actor):
    @endpoint
    def ping(self, x: bytes) -> bytes:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(frozen=True)
class Plan:
    """Iteration counts for one run."""

    floor_iters: int
    call_one_iters: int
    call_iters: int
    warmup: int
    broadcasts: int
    spawns: int


FULL = Plan(floor_iters=20_000, call_one_iters=5_000, call_iters=2_000, warmup=500, broadcasts=20_000, spawns=5)
QUICK = Plan(floor_iters=1_000, call_one_iters=300, call_iters=200, warmup=50, broadcasts=2_000, spawns=1)


@dataclass(frozen=True)
class Latency:
    p50: float  # seconds
    p99: float


@dataclass(frozen=True)
class Row:
    metric: str
    value: str
    baseline: str
    ratio: str


def latency(samples: list[float]) -> Latency:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return Latency(p50=q[49], p99=q[98])


def time_each(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


# --- raw socket floor -----------------------------------------------------------------------------------

def recv_some(sock: socket.socket, n: int, spin: float) -> bytes:
    """Up to n bytes: busy-poll for `spin` seconds (0: don't), then block."""
    until = time.perf_counter() + spin
    while spin:
        try:
            return sock.recv(n, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() >= until:
                break
    return sock.recv(n)


def recv_exact(sock: socket.socket, n: int, spin: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = recv_some(sock, n - got, spin)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def echo_forever(port: int, size: int, spin: float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            sock.sendall(recv_exact(sock, size, spin))


@contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """Run the block on `cpus` (nothing changes if empty), then restore this process's CPU mask."""
    saved = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def two_cores() -> tuple[set[int], set[int]]:
    """One core for each end of the ping-pong, so the floor always crosses cores (unpinned, the
    scheduler sometimes puts both ends on one core, and the numbers flip between runs)."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, {cpus[1]}) if len(cpus) > 1 else (set(), set())


@contextmanager
def echo_peer(size: int, spin: float) -> Iterator[socket.socket]:
    """A connected socket to a forked echo process on another core; the process is killed on exit."""
    mine, theirs = two_cores()
    with socket.create_server(("127.0.0.1", 0)) as listener, pinned(mine):
        port = listener.getsockname()[1]
        pid = os.fork()
        if pid == 0:
            listener.close()
            try:
                if theirs:
                    os.sched_setaffinity(0, theirs)
                echo_forever(port, size, spin)
            finally:
                os._exit(0)
        try:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield conn
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def socket_floor(size: int, spin: float, plan: Plan) -> Latency:
    payload = b"x" * size
    with echo_peer(size, spin) as sock:
        def round_trip() -> None:
            sock.sendall(payload)
            recv_exact(sock, size, spin)
        return latency(time_each(round_trip, plan.floor_iters, plan.warmup))


def pipe_floor(size: int, plan: Plan) -> Latency:
    """Round trips of `size` bytes through a multiprocessing.Pipe to a forked echo process."""
    payload = b"x" * size
    ours, theirs = multiprocessing.Pipe()
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            while True:
                theirs.send_bytes(theirs.recv_bytes())
        finally:
            os._exit(0)
    theirs.close()
    try:
        def round_trip() -> None:
            ours.send_bytes(payload)
            ours.recv_bytes()
        return latency(time_each(round_trip, plan.floor_iters, plan.warmup))
    finally:
        ours.close()  # the echo's recv_bytes raises EOFError, and it exits
        os.waitpid(pid, 0)


# --- monarch --------------------------------------------------------------------------------------------

def call_latency(send: Callable[[bytes], Future[object]], payload: bytes, iters: int, warmup: int) -> Latency:
    """Round trips of `send(payload).get()`, e.g. `send=actors.ping.call_one`."""
    return latency(time_each(lambda: send(payload).get(timeout=TIMEOUT), iters, warmup))


def broadcast_rate(echo: ActorMesh, payload: bytes, n: int) -> float:
    """Messages delivered per second: n broadcasts, then one call that returns after all of them ran."""
    ping = echo.ping
    t0 = time.perf_counter()
    for _ in range(n):
        ping.broadcast(payload)
    ping.call(payload).get(timeout=TIMEOUT)
    return n * len(echo) / (time.perf_counter() - t0)


def stop_with_torch() -> float:
    """Seconds `stop()` of a 4-proc mesh takes once its workers imported torch (a tensor op ran)."""
    import torch
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="bench-stop")
    with procs.activate():
        assert torch.ones(4).sum().item() == 4
    t0 = time.perf_counter()
    procs.stop().get(timeout=TIMEOUT)
    return time.perf_counter() - t0


def kill_detection() -> float:
    """Seconds from SIGKILL of a worker in the middle of a call to the SupervisionError on the caller."""
    return signal_detection(signal.SIGKILL, TIMEOUT)


def signal_detection(sig: int, wait: float) -> float:
    """Seconds from signal `sig` to a worker in the middle of a call to the SupervisionError on the caller
    (the worker is continued and the mesh stopped afterwards). The supervision event this raises is
    dropped here (a replaced monarch.actor.unhandled_fault_hook), so that the benchmark goes on."""
    default, monarch.actor.unhandled_fault_hook = monarch.actor.unhandled_fault_hook, lambda failure: None
    try:
        return _detection(sig, wait)
    finally:
        monarch.actor.unhandled_fault_hook = default


def _detection(sig: int, wait: float) -> float:
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="bench-signal")
    pid = procs.pids[1]
    try:
        echo = procs.spawn("echo", Echo)
        echo.sleep.call(0).get(timeout=TIMEOUT)
        pending = echo.sleep.call(wait)
        time.sleep(0.1)
        t0 = time.perf_counter()
        os.kill(pid, sig)
        try:
            pending.get(timeout=wait)
        except SupervisionError:
            return time.perf_counter() - t0
        raise AssertionError(f"a call on a worker given signal {sig} returned normally")
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        procs.stop()


# --- report ---------------------------------------------------------------------------------------------

def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def ratio(value: float, base: float) -> str:
    return f"{value / base:,.2f}x"


def rate(per_s: float) -> str:
    return f"{per_s:,.0f} msg/s"


def latency_rows(name: str, lat: Latency, base_name: str, base: Latency) -> list[Row]:
    return [Row(f"{name} p50", us(lat.p50), f"{base_name} p50 {us(base.p50)}", ratio(lat.p50, base.p50)),
            Row(f"{name} p99", us(lat.p99), f"{base_name} p99 {us(base.p99)}", ratio(lat.p99, base.p99))]


def floor_rows(name: str, lat: Latency) -> list[Row]:
    return [Row(f"{name} p50", us(lat.p50), "-", "-"), Row(f"{name} p99", us(lat.p99), "-", "-")]


def print_table(rows: list[Row]) -> None:
    header = Row("metric", "value", "baseline / floor", "ratio")
    cells = [header, *rows]
    widths = [max(len(getattr(r, f)) for r in cells) for f in ("metric", "value", "baseline", "ratio")]
    for i, r in enumerate(cells):
        print(f"{r.metric:<{widths[0]}}  {r.value:>{widths[1]}}  {r.baseline:<{widths[2]}}  {r.ratio:>{widths[3]}}")
        if i == 0:
            print("  ".join("-" * w for w in widths))


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def os_name() -> str:
    try:
        return f"{platform.freedesktop_os_release()['PRETTY_NAME']}, Linux {platform.release()}"
    except OSError:
        return platform.platform()


def machine(*extra: str) -> str:
    """The line a benchmark prints about where it ran (torch's version read without importing it)."""
    from importlib.metadata import version
    return ", ".join([f"machine: {cpu_model()}", f"{os.cpu_count()} cores", f"Python {platform.python_version()}",
                      f"torch {version('torch')}", os_name(), f"load average {os.getloadavg()[0]:.2f}", *extra])


def print_machine(size: int, quick: bool) -> None:
    spin_us = config.FLAGS["MONARCH_SPIN_US"].raw()
    print(f"monarch actor benchmarks, {datetime.date.today().isoformat()}, {'quick' if quick else 'full'} run, "
          f"payload {size} bytes")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, {os_name()}, "
          f"MONARCH_SPIN_US={spin_us}")
    print()


# --- main -----------------------------------------------------------------------------------------------

def mesh_rows(procs: ProcMesh, payload: bytes, plan: Plan, block: Latency, spin: Latency, pipe: Latency) -> list[Row]:
    echo = procs.spawn("echo", Echo)
    one = echo.slice(dp=0, tp=0)
    single = call_latency(one.ping.call_one, payload, plan.call_one_iters, plan.warmup)
    mesh = call_latency(echo.ping.call, payload, plan.call_iters, plan.warmup)
    bc_one = broadcast_rate(one, payload, plan.broadcasts)
    bc_mesh = broadcast_rate(echo, payload, plan.broadcasts)
    return [*latency_rows("call_one", single, "blocking floor", block),
            *latency_rows("call_one", single, "spin floor", spin),
            *latency_rows("call_one, 4 workers", single, "Pipe floor", pipe),
            *latency_rows("call, 4 procs", mesh, "call_one", single),
            Row("broadcast, 1 actor", rate(bc_one), f"1 / call_one p50 {rate(1 / single.p50)}",
                ratio(bc_one, 1 / single.p50)),
            Row("broadcast, 4 actors", rate(bc_mesh), f"broadcast, 1 actor {rate(bc_one)}", ratio(bc_mesh, bc_one))]


def sized_rows(payload: bytes, plan: Plan, pipe: Latency) -> list[Row]:
    """call_one of the first actor of fresh meshes of 1 and 2 workers (the other idle), against the Pipe floor."""
    rows = []
    for n in (1, 2):
        procs = this_host().spawn_procs(per_host={"gpus": n}, name=f"bench-{n}")
        try:
            first = procs.spawn("echo", Echo).slice(gpus=0)
            lat = call_latency(first.ping.call_one, payload, plan.call_one_iters, plan.warmup)
            rows += latency_rows(f"call_one, {n} worker{'s' if n > 1 else ''}", lat, "Pipe floor", pipe)
        finally:
            procs.stop()
    return rows


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def spawn_rows(plan: Plan, meta: str | None) -> list[Row]:
    """Spawn to first call of 2 and 4 procs against Meta's Monarch (interpreter `meta`, None: not installed), one
    side after the other for each size; then the first tensor op after a spawn, and bare interpreters."""
    k, rows, ours = plan.spawns, [], {}
    for n in (2, 4):
        ours[n] = statistics.median(spawn_times(n, k))
        base, rel = "Meta's Monarch: not installed", "-"
        if meta is not None:
            theirs = statistics.median(meta_spawn_times(meta, n, k))
            base, rel = f"Meta's Monarch {ms(theirs)}", ratio(ours[n], theirs)
        rows.append(Row(f"spawn {n} procs to first call (median of {k})", ms(ours[n]), base, rel))
    off = statistics.median(first_tensor_op(2, "off") for _ in range(k))
    on = statistics.median(first_tensor_op(2, "on") for _ in range(k))
    bare = statistics.median(bare_interpreters(4) for _ in range(k))
    return [*rows, Row(f"first tensor op after spawn, 2 procs, preload off (median of {k})", ms(off),
                       f"spawn 2 procs to first call {ms(ours[2])}", ratio(off, ours[2])),
            Row(f"first tensor op after spawn, 2 procs, preload on (median of {k})", ms(on),
                f"preload off {ms(off)}", ratio(on, off)),
            Row(f"4 bare pythons at once (median of {k})", ms(bare), "-", "-")]


def stop_row(plan: Plan) -> Row:
    n = max(plan.spawns, 5)
    stop = statistics.median(stop_with_torch() for _ in range(n))
    return Row(f"stop 4 procs with torch imported (median of {n})", f"{stop * 1e3:,.0f} ms", "target 300 ms",
               ratio(stop, 0.3))


def kill_row(plan: Plan) -> Row:
    detect = statistics.median(kill_detection() for _ in range(plan.spawns))
    return Row(f"kill -9 to SupervisionError (median of {plan.spawns})", f"{detect * 1e3:,.1f} ms",
               "target 1,000 ms", ratio(detect, 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few iterations, a smoke test")
    parser.add_argument("--payload", type=int, default=100, help="bytes per message (default 100)")
    parser.add_argument("--monarch-python", metavar="PATH", help="the Python of an installation of Meta's "
                        "Monarch (torchmonarch), timed next to ours (default: /opt/monarch-venv/bin/python if present)")
    args = parser.parse_args()
    meta = meta_python(args.monarch_python)
    plan = QUICK if args.quick else FULL
    payload = b"x" * args.payload
    print_machine(args.payload, args.quick)
    print(f"Meta's Monarch: {meta} (torchmonarch {meta_version(meta)})" if meta else "Meta's Monarch: not installed "
          "(no /opt/monarch-venv/bin/python, and no --monarch-python PATH): the spawn rows have no baseline")
    block = socket_floor(args.payload, 0.0, plan)  # floors first: fork before monarch starts any thread
    spin = socket_floor(args.payload, config.spin_seconds(), plan)
    pipe = pipe_floor(args.payload, plan)
    rows = [*floor_rows("floor: TCP ping-pong, blocking", block),
            *floor_rows(f"floor: TCP ping-pong, spin {config.spin_seconds() * 1e6:g} µs", spin),
            *floor_rows("floor: multiprocessing.Pipe echo", pipe)]
    procs = this_host().spawn_procs(per_host={"dp": 2, "tp": 2}, name="bench")
    try:
        rows += mesh_rows(procs, payload, plan, block, spin, pipe)
    finally:
        procs.stop()
    rows += sized_rows(payload, plan, pipe)
    rows += [*spawn_rows(plan, meta), stop_row(plan), kill_row(plan)]
    print_table(rows)


if __name__ == "__main__":
    main()
