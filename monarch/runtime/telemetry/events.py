"""Telemetry events: the tables every process records into, cheaply and always on.

A process extends one flat list per table with each event's values (one `extend` per event,
timestamps in µs since the epoch); workers ship what they have in batches over the control plane
(when asked, and on their own once a batch is large: a worker's `Collector`), and the controller loads
them into its embedded database (store.py).
The column lists below are the documented schema of each table.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from monarch import config
from monarch.errors import ActorError, RemoteError

TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "procs": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("pid", "INTEGER"), ("host", "VARCHAR"),
              ("event", "VARCHAR"), ("detail", "VARCHAR"), ("time_us", "BIGINT")),
    "actors": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("actor", "VARCHAR"), ("class", "VARCHAR"),
               ("time_us", "BIGINT")),
    "messages": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("actor", "VARCHAR"), ("endpoint", "VARCHAR"),
                 ("sender", "VARCHAR"), ("bytes", "BIGINT"), ("enqueue_us", "BIGINT"), ("start_us", "BIGINT"),
                 ("end_us", "BIGINT"), ("status", "VARCHAR")),
    "ops": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("program", "BIGINT"), ("op", "VARCHAR"),
            ("instructions", "INTEGER"), ("start_us", "BIGINT"), ("end_us", "BIGINT")),
    "collectives": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("kind", "VARCHAR"), ("mdim", "INTEGER"),
                    ("bytes", "BIGINT"), ("start_us", "BIGINT"), ("end_us", "BIGINT"), ("transport", "VARCHAR")),
    "memory": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("rss_bytes", "BIGINT"), ("tensor_bytes", "BIGINT"),
               ("buffers", "INTEGER"), ("cuda_allocated_bytes", "BIGINT"), ("cuda_reserved_bytes", "BIGINT"),
               ("time_us", "BIGINT"), ("cuda_peak_bytes", "BIGINT")),
    "logs": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("stream", "VARCHAR"), ("level", "VARCHAR"),
             ("text", "VARCHAR"), ("time_us", "BIGINT")),
    "failures": (("rank", "INTEGER"), ("mesh", "VARCHAR"), ("kind", "VARCHAR"), ("what", "VARCHAR"),
                 ("detail", "VARCHAR"), ("time_us", "BIGINT")),
}
WORKER_TABLES = ("messages", "ops", "collectives", "memory", "logs")  # recorded without mesh: added on arrival
BATCH = 4096        # a worker ships its events unasked once it holds this many
MEMORY_EVERY_S = 1.0  # a busy worker samples its memory this often (and whenever it ships events)
LIMIT = 1_000_000   # events a process keeps before it drops the oldest half of a table
DETAIL_CHARS = 500  # the failures table keeps this much of a remote error's message


@dataclass(frozen=True)
class Events:
    """A batch of events of one process: by table name, the rows laid end to end in one flat list
    (`width(table)` values per row), so recording and shipping create no Python object per event."""
    rows: dict[str, list]

    def table(self, name: str) -> Iterator[tuple]:
        """The rows of one table, as tuples in recorded order."""
        flat = self.rows.get(name, [])
        return zip(*[iter(flat)] * width(name), strict=True)


def recorded(table: str) -> list[str]:
    """The columns of a row as recorded: workers leave out the mesh, which the controller adds on arrival."""
    return [c for c, _ in TABLES[table] if c != "mesh" or table not in WORKER_TABLES]


def width(table: str) -> int:
    return len(recorded(table))


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


def imported(name: str) -> ModuleType | None:
    """Module `name` once its import finished; None before, and while a thread is still importing it (a worker
    imports torch on a background thread while it starts, and sys.modules holds it from the import's start)."""
    module = sys.modules.get(name)
    return None if module is None or getattr(module.__spec__, "_initializing", False) else module


def cuda_bytes() -> tuple[int, int, int]:
    """Bytes allocated, reserved and at most allocated so far (torch.cuda.max_memory_allocated) by torch's CUDA
    caching allocator in this process (zeros without CUDA in use); never imports torch or initializes CUDA."""
    torch = imported("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0, 0, 0
    devices = range(torch.cuda.device_count())
    return (sum(int(torch.cuda.memory_allocated(d)) for d in devices),
            sum(int(torch.cuda.memory_reserved(d)) for d in devices),
            sum(int(torch.cuda.max_memory_allocated(d)) for d in devices))


def error_text(e: BaseException) -> str:
    """A remote error (unpickled by the caller) as a failures row's detail: its type and message, without the
    remote traceback and the hints of an ActorError, cut to DETAIL_CHARS."""
    text = str(e).partition("\n\nRemote traceback:")[0]
    if isinstance(e, ActorError):  # "Type: message\n  raised by <endpoint> on rank <r> ...; hints"
        text = text.partition("\n  raised by ")[0]
    elif not isinstance(e, RemoteError):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


class CallRecord(Protocol):
    """What the messages table keeps of a call a worker ran (control.commands.Call)."""

    @property
    def actor(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def sender(self) -> str: ...

    @property
    def args(self) -> bytes: ...


class Collector:
    """A worker's telemetry: when calls arrived and ran (the messages table, recorded off the replies' path),
    memory samples (of the tensors `tensors()` gives: the tensor engine's store), and the batches it ships."""

    def __init__(self, rank: int, tensors: Callable[[], Iterable[Any]]) -> None:
        self.rank = rank
        self._tensors = tensors
        self._arrived: dict[int, int] = {}  # id(call) -> when it arrived (µs)
        self._ran: list[tuple[CallRecord, int, int, bool]] = []  # calls run since the last flush: start, end, ok
        self._sampled = 0.0  # time.monotonic() of the last memory sample

    @staticmethod
    def now() -> int:
        """When a frame arrived (µs), or 0 while recording is off."""
        return now_us() if RECORDER.on else 0

    def arrived(self, call: CallRecord, when: int) -> None:
        self._arrived[id(call)] = when

    def ran(self, call: CallRecord, start: int, ok: bool) -> None:
        if RECORDER.on:
            self._ran.append((call, start, now_us(), ok))
        elif self._arrived:  # recording was switched off while this call waited
            self._arrived.pop(id(call), None)

    def batch(self) -> Events | None:
        """The events to ship unasked, once there are BATCH of them."""
        return self.events() if RECORDER.count >= BATCH else None

    def flushed(self) -> None:
        """After a frame went out: record the calls that ran, and a memory sample when the last is
        MEMORY_EVERY_S old."""
        if self._ran:
            self._record_calls()
        if RECORDER.on and time.monotonic() >= self._sampled + MEMORY_EVERY_S:
            self._sample_memory()

    def events(self) -> Events:
        """This worker's pending events, with a memory sample."""
        self._record_calls()
        self._sample_memory()
        return RECORDER.take()

    def _record_calls(self) -> None:
        for call, start, end, ok in self._ran:
            RECORDER.add("messages", (self.rank, call.actor, call.endpoint, call.sender or "controller",
                                      len(call.args), self._arrived.pop(id(call), start), start, end,
                                      "ok" if ok else "error"))
        self._ran.clear()

    def _sample_memory(self) -> None:
        tensors = [v for v in self._tensors() if hasattr(v, "nbytes")]
        allocated, reserved, peak = cuda_bytes()
        RECORDER.add("memory", (self.rank, rss_bytes(), sum(t.nbytes for t in tensors), len(tensors), allocated,
                                reserved, now_us(), peak))
        self._sampled = time.monotonic()


def output_lines(shape: Any, stream: str, text: str) -> Events:
    """Worker output, `[dp=0,tp=1] text` per line as the monitors prefix it, as rows of `logs` (no level)."""
    now = now_us()
    flat: list[Any] = []
    for line in text.splitlines():
        label, _, rest = line.partition("] ")
        flat.extend((_rank_of(shape, label.removeprefix("[")) if rest else -1, stream, "", rest or line, now))
    return Events({"logs": flat})


def record_logging(rank: int) -> None:
    """Record every `logging` record this process creates into `logs` (stream "logging", with its level).
    It wraps the record factory, not a handler: handlers, `basicConfig` and logging's last resort behave
    as if monarch were not there. A record exists only when its logger is enabled for its level."""
    make = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if RECORDER.on:
            try:
                text = f"{record.name}: {record.getMessage()}"
            except Exception:  # noqa: BLE001 - bad format arguments: logging itself reports those later
                text = f"{record.name}: {record.msg}"
            if record.exc_info:
                text += "\n" + formatter.formatException(record.exc_info)
            RECORDER.add("logs", (rank, "logging", record.levelname, text, int(record.created * 1e6)))
        return record

    logging.setLogRecordFactory(factory)


def _rank_of(shape: Any, label: str) -> int:
    try:
        coords = tuple(int(kv.split("=")[1]) for kv in label.split(","))
        return int(shape.rank_at(coords))
    except (ValueError, IndexError):  # not a label of this mesh
        return -1
