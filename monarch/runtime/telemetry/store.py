"""The controller's telemetry database: an embedded DuckDB (in memory, or MONARCH_TELEMETRY_DB).

Events wait as they came (flat lists, see telemetry.Events) and are loaded column by column through numpy
before a query, or once many wait (by a thread that finds the database free: the poller never waits).
Each table keeps its newest MONARCH_TELEMETRY_RETAIN rows. Queries only read (no file, network or extension
access, locked configuration) on a cursor of their own, beside the loading, until their time limit or their
client is gone; `sql()` returns `Rows`, a list of tuples that knows its column names.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch import config
from monarch.errors import MonarchError
from monarch.runtime.telemetry.events import TABLES, WORKER_TABLES, Events, width
from monarch.runtime.telemetry.otel import Exporter, from_environment

LOAD_AT = 50_000  # pending events that are loaded into the database without waiting for a query
COMPACT_AT = 50_000  # dropped rows after which a CHECKPOINT hands their memory back (DELETE only marks them)
LOCKED = {"enable_external_access": False, "autoinstall_known_extensions": False,  # set before the tables exist
          "autoload_known_extensions": False, "allow_community_extensions": False,
          "python_enable_replacements": False}  # no scans of the caller's Python variables by name
ALLOWED = "SELECT, WITH, VALUES, DESCRIBE, SHOW, SUMMARIZE, and EXPLAIN [ANALYZE] of one of those"
WATCH_S = 0.05  # how often a running query's time limit and client are checked


class QueryRefused(MonarchError):
    """A telemetry query tried something other than reading the tables (telemetry SQL is read-only)."""


class QueryTimeout(MonarchError, TimeoutError):
    """A telemetry query ran past its time limit (MONARCH_QUERY_TIMEOUT, or the caller's) and was cancelled."""


class QueryCancelled(MonarchError):
    """A telemetry query was cancelled because the client that asked for it went away."""


@dataclass(frozen=True)
class Limits:
    """What ends a query early: `timeout` s of running (None: MONARCH_QUERY_TIMEOUT; 0: never), or
    `gone()` turning True (polled every WATCH_S s: the client that asked hung up)."""
    timeout: float | None = None
    gone: Callable[[], bool] | None = None

    def seconds(self) -> float:
        return config.query_timeout() if self.timeout is None else self.timeout


class Rows(list):
    """Query results: a list of tuples, with `.columns`; `.df()` with pandas, `.arrow()` with pyarrow.
    `.late` names the ranks (`mesh[rank]`) whose newest events were not in yet when the query ran."""

    def __init__(self, rows: list[tuple], columns: list[str], late: list[str] | None = None) -> None:
        super().__init__(rows)
        self.columns = columns
        self.late = late or []

    def df(self) -> Any:
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Rows.df() needs pandas: pip install pandas") from None
        return pd.DataFrame(list(self), columns=self.columns)

    def arrow(self) -> Any:
        try:
            import pyarrow as pa
        except ImportError:
            raise ImportError("Rows.arrow() needs pyarrow: pip install pyarrow") from None
        return pa.table({c: [r[i] for r in self] for i, c in enumerate(self.columns)})


class Store:
    """Pending events and the DuckDB connection they are loaded into; each table keeps its newest
    `retain` rows (MONARCH_TELEMETRY_RETAIN, 0: all), in order of arrival."""

    def __init__(self, retain: int | None = None) -> None:
        self._lock = threading.Lock()      # guards the pending batches
        self._db_lock = threading.Lock()   # one thread at a time uses the DuckDB connection
        self._pending: dict[str, deque[tuple[str, list]]] = {t: deque() for t in TABLES}  # (mesh, flat rows)
        self._pending_rows = dict.fromkeys(TABLES, 0)
        self._waiting = 0
        self._stored = dict.fromkeys(TABLES, 0)  # rows of each table in the database
        self._dropped = 0  # rows deleted since the last checkpoint
        self._con: Any = None
        self.retain = config.telemetry_retain() if retain is None else retain
        self.exporter: Any = from_environment()

    def export_to(self, provider: Any, meters: Any = None) -> None:
        """Also send every later batch of events to these OpenTelemetry tracer and meter providers."""
        self.exporter = Exporter(provider, meters)

    def add(self, events: Events, mesh: str = "") -> None:
        """Keep a batch; rows of the worker tables get `mesh` (the mesh of the process that sent them)."""
        if self.exporter is not None:
            self.exporter.export(events)
        with self._lock:
            for table, flat in events.rows.items():
                if table in self._pending:
                    n = len(flat) // width(table)
                    self._pending[table].append((mesh, flat))
                    self._pending_rows[table] += n
                    self._waiting += n
                    self._drop_pending(table)
            full = self._waiting >= LOAD_AT
        if full and self._db_lock.acquire(blocking=False):  # else another thread is loading: they wait
            try:  # nobody asked for a while: keep the events in DuckDB's columns, not as Python tuples
                self._load(self._connect())
            finally:
                self._db_lock.release()

    def sql(self, query: str, late: list[str] | None = None, limits: Limits | None = None) -> Rows:
        """Run `query` over every event recorded so far (`late`: ranks known to be missing events), on a
        cursor of its own: QueryTimeout past `limits.timeout`, QueryCancelled once `limits.gone()`.
        Only reads run: anything else raises QueryRefused and changes nothing."""
        import duckdb
        with self._db_lock:
            con = self._connect()
            check_read_only(con, query)
            self._load(con)
            cur = con.cursor()
        watch = _Watch(cur, limits or Limits())
        try:
            with cur, watch:
                result = cur.execute(query)
                return Rows(result.fetchall(), [d[0] for d in result.description or ()], late)
        except duckdb.InterruptException:
            if not watch.why:
                raise
            raise watch.error(query) from None
        except duckdb.PermissionException as e:
            raise QueryRefused(f"telemetry SQL has no access to files, the network or extensions: {e}; "
                               f"query the tables ({', '.join(TABLES)}) instead") from None

    def _drop_pending(self, table: str) -> None:
        """Forget the oldest waiting batches of `table` that the retention would drop once loaded."""
        batches, n = self._pending[table], width(table)
        while self.retain and len(batches) > 1:
            first = len(batches[0][1]) // n
            if self._pending_rows[table] - first < self.retain:
                return
            batches.popleft()
            self._pending_rows[table] -= first
            self._waiting -= first

    def _connect(self) -> Any:
        if self._con is None:
            import duckdb
            con = duckdb.connect(config.telemetry_db() or ":memory:", config=LOCKED)
            for table, cols in TABLES.items():
                con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{c} {t}' for c, t in cols)})")
                self._stored[table] = con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]
                self._drop_oldest(con, table)
            con.execute("SET lock_configuration = true")
            self._con = con
        return self._con

    def _load(self, con: Any) -> None:
        import numpy as np  # with DuckDB, on the first query: processes that never query (workers) never load it
        with self._lock:
            pending, self._pending = self._pending, {t: deque() for t in TABLES}
            self._pending_rows = dict.fromkeys(TABLES, 0)
            self._waiting = 0
        keep = slice(-self.retain, None) if self.retain else slice(None)
        for table, batches in pending.items():
            if not batches:
                continue
            cols = TABLES[table]
            data = {name: np.concatenate([np.array(part, dtype=object if kind == "VARCHAR" else np.int64)
                                          for part in column])[keep]
                    for (name, kind), column in zip(cols, _columns(table, batches), strict=True)}
            con.register("_batch", data)
            con.execute(f"INSERT INTO {table} SELECT {', '.join(c for c, _ in cols)} FROM _batch")
            con.unregister("_batch")
            self._stored[table] += len(data["rank"])
            self._drop_oldest(con, table)
        if self._dropped and self._dropped >= min(self.retain, COMPACT_AT):
            con.execute("CHECKPOINT")
            self._dropped = 0

    def _drop_oldest(self, con: Any, table: str) -> None:
        excess = self._stored[table] - self.retain
        if self.retain and excess > 0:
            oldest = f"SELECT rowid FROM {table} ORDER BY rowid LIMIT {excess}"
            con.execute(f"DELETE FROM {table} WHERE rowid IN ({oldest})")
            self._stored[table] = self.retain
            self._dropped += excess


class _Watch:
    """While a query runs on `cur`: interrupts it once its time is up or its client is gone (again every
    WATCH_S s until it ends, so an interrupt that came before the query started is not lost)."""

    def __init__(self, cur: Any, limits: Limits) -> None:
        self.cur, self.limits, self.seconds = cur, limits, limits.seconds()
        self.why = ""  # "timeout" or "gone" once interrupted
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monarch-query-watch", daemon=True)

    def __enter__(self) -> _Watch:
        if self.seconds > 0 or self.limits.gone is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10 * WATCH_S)

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds if self.seconds > 0 else None
        gone = self.limits.gone
        while not self._done.wait(WATCH_S):
            if not self.why and gone is not None and gone():
                self.why = "gone"
            elif not self.why and deadline is not None and time.monotonic() >= deadline:
                self.why = "timeout"
            if self.why:
                self.cur.interrupt()

    def error(self, query: str) -> MonarchError:
        shown = " ".join(query.split())[:80]
        if self.why == "gone":
            return QueryCancelled(f"the telemetry query {shown!r} was cancelled: its client went away")
        return QueryTimeout(f"the telemetry query {shown!r} ran for more than {self.seconds:g} s and was cancelled; "
                            "narrow it, or allow more time: procs.sql(..., query_timeout=S), `monarch query "
                            "--timeout S`, or MONARCH_QUERY_TIMEOUT (0: no limit) in the controller's environment")


def check_read_only(con: Any, query: str) -> None:
    """Raise QueryRefused unless every statement of `query` only reads, as DuckDB's parser classifies
    them (DESCRIBE, SHOW, SUMMARIZE and VALUES parse as SELECT); EXPLAIN must wrap a read, since
    EXPLAIN ANALYZE runs what it wraps."""
    for statement in con.extract_statements(query):
        kind = statement.type.name
        if kind == "SELECT" or kind == "EXPLAIN" and _reads(con, _explained(statement.query)):
            continue
        words = statement.query.split()
        what = ("an EXPLAIN of something other than a read (EXPLAIN ANALYZE runs it)" if kind == "EXPLAIN"
                else f"{words[0].upper() if words else kind} ({kind.lower()} statement)")
        raise QueryRefused(f"telemetry SQL is read-only: refused {what}: {' '.join(words)[:80]!r}; "
                           f"allowed: {ALLOWED}. Nothing was run.")


def _reads(con: Any, text: str) -> bool:
    """Whether `text` is exactly one SELECT statement."""
    import duckdb
    try:
        statements = con.extract_statements(text)
    except duckdb.Error:
        return False
    return len(statements) == 1 and statements[0].type.name == "SELECT"


def _explained(text: str) -> str:
    """What `EXPLAIN [ANALYZE] [(options)] <statement>` wraps, as text ('' when `text` is not that)."""
    import duckdb
    marks = duckdb.tokenize(text)
    ends = [p for p, _ in marks[1:]] + [len(text)]
    words = [(p, kind, text[p:q].strip().upper())
             for (p, kind), q in zip(marks, ends, strict=True) if kind != duckdb.token_type.comment]
    if not words or words[0][2] != "EXPLAIN":
        return ""
    i = 2 if len(words) > 1 and words[1][2] in ("ANALYZE", "ANALYSE") else 1
    if i < len(words) and words[i][2] == "(":  # options: skip to the closing parenthesis
        depth = 0
        for i in range(i, len(words)):
            if words[i][1] == duckdb.token_type.operator:
                depth += words[i][2].count("(") - words[i][2].count(")")
            if depth == 0:
                break
        i += 1
    return text[words[i][0]:] if i < len(words) else ""


def _columns(table: str, batches: list[tuple[str, list]]) -> list[list[list]]:
    """Per column of `table`, its values in each batch (the mesh column filled in for worker tables)."""
    n = width(table)
    columns = [[flat[i::n] for _, flat in batches] for i in range(n)]
    if table in WORKER_TABLES:
        columns.insert(1, [[mesh] * (len(flat) // n) for mesh, flat in batches])
    return columns


STORE = Store()
