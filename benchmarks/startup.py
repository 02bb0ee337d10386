"""Start-up of a local proc mesh, timed by the same code for monarch and for Meta's Monarch (torchmonarch).

`spawn_times(n, reps)`: one untimed spawn, then `reps` fresh meshes, each timed from
`this_host().spawn_procs(per_host={"procs": n})` until the first `call` of an actor spawned on it answered
(stop not timed). actors.py runs it for monarch in its own process, and for Meta's Monarch as
`python startup.py --procs N --reps K` under that installation's interpreter (`meta_spawn_times`), in a
subprocess, so that the two never share a process; `monarch.actor` is whichever the interpreter has.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from monarch.actor import Actor, endpoint, this_host

TIMEOUT = 60.0  # seconds any single wait may take
META_PYTHON = "/opt/monarch-venv/bin/python"  # `python3 -m venv /opt/monarch-venv && pip install torchmonarch`


class Ping(Actor):
    @endpoint
    def ping(self, x: bytes) -> bytes:
        return x


def spawn_to_first_call(n: int) -> float:
    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": n})
    try:
        procs.spawn("ping", Ping).ping.call(b"x").get(timeout=TIMEOUT)
        return time.perf_counter() - t0
    finally:
        procs.stop().get(timeout=TIMEOUT)


def spawn_times(n: int, reps: int) -> list[float]:
    """Seconds of `reps` fresh spawns of n procs to their first answer, after one untimed spawn (whatever
    a process sets up on its first mesh is in neither side's numbers)."""
    spawn_to_first_call(n)
    return [spawn_to_first_call(n) for _ in range(reps)]


def first_tensor_op(n: int, preload: str) -> float:
    """Seconds from spawn_procs of n procs (MONARCH_PRELOAD_TORCH=`preload` for its workers) until a first tensor
    op on them returned its value: the workers load torch and create their tensor engine on it."""
    import torch
    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": n}, env={"MONARCH_PRELOAD_TORCH": preload})
    try:
        with procs.activate():
            assert torch.ones(4).sum().item() == 4
        return time.perf_counter() - t0
    finally:
        procs.stop().get(timeout=TIMEOUT)


def bare_interpreters(n: int) -> float:
    t0 = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(n)]
    for child in children:
        child.wait(timeout=TIMEOUT)
    return time.perf_counter() - t0


def meta_python(path: str | None) -> str | None:
    """The interpreter of Meta's Monarch: `path` (--monarch-python), else META_PYTHON where it exists."""
    if path:
        if not os.access(path, os.X_OK):
            raise SystemExit(f"--monarch-python {path}: not an executable; give the python of a venv with "
                             "torchmonarch installed, or leave the option out to skip Meta's rows")
        return path
    return META_PYTHON if os.access(META_PYTHON, os.X_OK) else None


def meta_version(python: str) -> str:
    done = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('torchmonarch'))"],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=tempfile.gettempdir())
    return done.stdout.strip() or "unknown version"


def meta_spawn_times(python: str, n: int, reps: int) -> list[float]:
    """`spawn_times(n, reps)` of Meta's Monarch: this file run by its interpreter, in a temporary directory and
    without PYTHONPATH, so that `monarch` there is Meta's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([python, os.path.abspath(__file__), "--procs", str(n), "--reps", str(reps)], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=TIMEOUT * (reps + 2))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} startup.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="spawn-to-first-call times of this interpreter's monarch (JSON)")
    parser.add_argument("--procs", type=int, required=True)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(spawn_times(args.procs, args.reps)), flush=True)


if __name__ == "__main__":
    main()
