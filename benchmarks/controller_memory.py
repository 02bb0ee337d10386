"""The controller's memory over a million actor calls, with telemetry retention on and off.

Run: `.venv/bin/python benchmarks/controller_memory.py [--calls 1000000] [--baseline 250000]`.
Each setting runs in a fresh controller process: `call_one` on a one-process mesh, and at 0, 1/4,
1/2, 3/4 and all of the calls the controller's RSS, then one query (which loads every waiting event
into the database), the RSS after it and the rows of `messages`. The retained run uses the
MONARCH_TELEMETRY_RETAIN in force (default 100,000); the baseline (MONARCH_TELEMETRY_RETAIN=0, every
row kept) runs fewer calls.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from monarch import config
from monarch.actor import Actor, endpoint, this_host
from monarch.runtime.telemetry.events import rss_bytes


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


def measure(calls: int) -> list[dict[str, float]]:
    """Make `calls` calls; at each quarter the RSS before and after a query, and the stored rows."""
    points = sorted({0, calls // 4, calls // 2, 3 * calls // 4, calls})
    rows, started = [], time.perf_counter()
    with this_host().spawn_procs(per_host={"x": 1}, name="memory") as procs:
        one = procs.spawn("echo", Echo).slice(x=0)
        one.ping.call_one(0).get(timeout=30)
        done = 0
        for point in points:
            for i in range(done, point):
                one.ping.call_one(i).get(timeout=30)
            done = point
            before = rss_bytes()
            [(stored,)] = procs.sql("SELECT count(*) FROM messages")
            rows.append({"calls": point, "rss_mb": before / 2**20, "after_query_mb": rss_bytes() / 2**20,
                         "messages": stored, "seconds": time.perf_counter() - started})
    return rows


def run(calls: int, retain: str) -> list[dict[str, float]]:
    """`measure(calls)` in a fresh controller process with MONARCH_TELEMETRY_RETAIN=`retain`."""
    env = {**os.environ, "MONARCH_TELEMETRY_RETAIN": retain}
    out = subprocess.run([sys.executable, __file__, "--child", str(calls)], env=env, capture_output=True,
                         text=True, timeout=3600, check=True).stdout
    return json.loads(out.rsplit("RESULT ", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=1_000_000, help="calls with retention on")
    p.add_argument("--baseline", type=int, default=250_000, help="calls with retention off")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print("RESULT", json.dumps(measure(a.child)), flush=True)
        return
    print(f"monarch controller_memory, {time.strftime('%Y-%m-%d')}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, torch {torch.__version__}, {platform.platform()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    retained = str(config.telemetry_retain())
    print(f"{'setting':34} {'calls':>9} {'RSS MB':>8} {'after query':>12} {'messages rows':>14} {'seconds':>8}")
    for label, calls, retain in ((f"retain {int(retained):,} rows per table", a.calls, retained),
                                 ("baseline: retain all (0)", a.baseline, "0")):
        for r in run(calls, retain):
            print(f"{label:34} {r['calls']:>9,} {r['rss_mb']:>8.1f} {r['after_query_mb']:>12.1f} "
                  f"{r['messages']:>14,} {r['seconds']:>8.0f}")


if __name__ == "__main__":
    main()
