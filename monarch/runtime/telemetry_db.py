"""The controller's telemetry database: an embedded DuckDB (in memory, or MONARCH_TELEMETRY_DB).

Events from the controller itself and batches from the workers wait as they came (flat lists, see
telemetry.Events) and are loaded into DuckDB, column by column through numpy, right before a query
runs or once many are waiting; `sql()` returns `Rows`, a list of tuples that knows its column names.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from monarch import config
from monarch.runtime.otel import Exporter, from_environment
from monarch.runtime.telemetry import TABLES, WORKER_TABLES, Events, width


LOAD_AT = 200_000  # pending events that are loaded into the database without waiting for a query


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
    """Pending events and the DuckDB connection they are loaded into."""

    def __init__(self) -> None:
        self._lock = threading.Lock()      # guards the pending lists
        self._db_lock = threading.Lock()   # one thread at a time uses the DuckDB connection
        self._pending: dict[str, list[tuple[str, list]]] = {t: [] for t in TABLES}  # (mesh, flat rows)
        self._waiting = 0
        self._con: Any = None
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
                    self._pending[table].append((mesh, flat))
                    self._waiting += len(flat) // width(table)
            full = self._waiting >= LOAD_AT
        if full:  # nobody asked for a while: keep the events in DuckDB's columns, not as Python tuples
            with self._db_lock:
                self._load(self._connect())

    def sql(self, query: str, late: list[str] | None = None) -> Rows:
        """Run `query` over every event recorded so far (`late`: ranks known to be missing events)."""
        with self._db_lock:
            con = self._connect()
            self._load(con)
            cur = con.execute(query)
            return Rows(cur.fetchall(), [d[0] for d in cur.description or ()], late)

    def _connect(self) -> Any:
        if self._con is None:
            import duckdb
            self._con = duckdb.connect(config.telemetry_db() or ":memory:")
            for table, cols in TABLES.items():
                self._con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{c} {t}' for c, t in cols)})")
        return self._con

    def _load(self, con: Any) -> None:
        with self._lock:
            pending, self._pending = self._pending, {t: [] for t in TABLES}
            self._waiting = 0
        for table, batches in pending.items():
            if not batches:
                continue
            cols = TABLES[table]
            data = {name: np.concatenate([np.array(part, dtype=object if kind == "VARCHAR" else np.int64)
                                          for part in column])
                    for (name, kind), column in zip(cols, _columns(table, batches), strict=True)}
            con.register("_batch", data)
            con.execute(f"INSERT INTO {table} SELECT {', '.join(c for c, _ in cols)} FROM _batch")
            con.unregister("_batch")


def _columns(table: str, batches: list[tuple[str, list]]) -> list[list[list]]:
    """Per column of `table`, its values in each batch (the mesh column filled in for worker tables)."""
    n = width(table)
    columns = [[flat[i::n] for _, flat in batches] for i in range(n)]
    if table in WORKER_TABLES:
        columns.insert(1, [[mesh] * (len(flat) // n) for mesh, flat in batches])
    return columns


STORE = Store()
