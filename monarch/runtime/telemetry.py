"""Telemetry events: the tables every process records into, cheaply and always on.

A process extends one flat list per table with each event's values (one `extend` per event,
timestamps in µs since the epoch); workers ship what they have in batches over the control plane
(when asked, and on their own once a batch is large), and the controller loads them into its
embedded database (telemetry_db.py).
The column lists below are the documented schema of each table.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

from monarch import config

TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "procs": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("pid", "INTEGER"), ("host", "VARCHAR"),
              ("event", "VARCHAR"), ("detail", "VARCHAR"), ("time_us", "BIGINT")),
    "actors": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("actor", "VARCHAR"), ("class", "VARCHAR"),
               ("time_us", "BIGINT")),
    "messages": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("actor", "VARCHAR"), ("endpoint", "VARCHAR"),
                 ("bytes", "BIGINT"), ("enqueue_us", "BIGINT"), ("start_us", "BIGINT"), ("end_us", "BIGINT"),
                 ("status", "VARCHAR")),
    "ops": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("program", "BIGINT"), ("op", "VARCHAR"),
            ("instructions", "INTEGER"), ("start_us", "BIGINT"), ("end_us", "BIGINT")),
    "collectives": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("kind", "VARCHAR"), ("mdim", "INTEGER"),
                    ("bytes", "BIGINT"), ("start_us", "BIGINT"), ("end_us", "BIGINT")),
    "memory": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("rss_bytes", "BIGINT"), ("tensor_bytes", "BIGINT"),
               ("buffers", "INTEGER"), ("time_us", "BIGINT")),
    "logs": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("stream", "VARCHAR"), ("text", "VARCHAR"),
             ("time_us", "BIGINT")),
    "failures": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("kind", "VARCHAR"), ("what", "VARCHAR"),
                 ("detail", "VARCHAR"), ("time_us", "BIGINT")),
}
WORKER_TABLES = ("messages", "ops", "collectives", "memory")  # recorded without their mesh: added on arrival
BATCH = 4096        # a worker ships its events unasked once it holds this many
LIMIT = 1_000_000   # events a process keeps before it drops the oldest half of a table


@dataclass(frozen=True)
class Events:
    """A batch of events of one process: by table name, the rows laid end to end in one flat list
    (`width(table)` values per row), so recording and shipping create no Python object per event."""
    rows: dict[str, list]

    def table(self, name: str) -> Iterator[tuple]:
        """The rows of one table, as tuples in recorded order."""
        flat = self.rows.get(name, [])
        return zip(*[iter(flat)] * width(name), strict=True)


def width(table: str) -> int:
    """Values per recorded row: workers leave out the mesh, which the controller adds on arrival."""
    return len(TABLES[table]) - (table in WORKER_TABLES)


class Recorder:
    """This process's pending events. `add` extends a flat list of atoms (ints and strings), which
    the garbage collector does not track, so always-on recording never triggers collections."""

    def __init__(self) -> None:
        self.on = config.telemetry()
        self.rows: dict[str, list] = {t: [] for t in TABLES}
        self.count = 0

    def add(self, table: str, row: tuple) -> None:
        flat = self.rows[table]
        flat.extend(row)
        self.count += 1
        if len(flat) > LIMIT * len(row):
            del flat[:LIMIT // 2 * len(row)]

    def take(self) -> Events:
        rows, self.rows = self.rows, {t: [] for t in TABLES}
        self.count = 0
        return Events({t: r for t, r in rows.items() if r})


RECORDER = Recorder()


def now_us() -> int:
    return time.time_ns() // 1000


def rss_bytes() -> int:
    """Resident memory of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def record_logs(mesh: str, shape: Any, stream: str, text: str) -> None:
    """Worker output lines, `[dp=0,tp=1] text` as the monitors prefix them, into the logs table."""
    now = now_us()
    for line in text.splitlines():
        label, _, rest = line.partition("] ")
        rank = _rank_of(shape, label.removeprefix("[")) if rest else -1
        RECORDER.add("logs", (rank, mesh, stream, rest or line, now))


def _rank_of(shape: Any, label: str) -> int:
    try:
        coords = tuple(int(kv.split("=")[1]) for kv in label.split(","))
        return int(shape.rank_at(coords))
    except (ValueError, IndexError, AssertionError):
        return -1
