"""`monarch top`: a live terminal view of a running controller, drawn from its telemetry tables.

The view is three rich renderables, each built from one SQL query that a `Query` runs on the controller
(`monarch top` passes the admin endpoint's client, runtime/debug/admin.py): the mesh tree (hosts -> procs ->
actors, with status), activity per rank (message rate, busy time, memory) and the latest failures. `--once`
prints them; otherwise `Top`, a textual app, redraws them every `interval` seconds above a SQL prompt (Enter
runs the query, Up/Down walk the history, Ctrl+Q quits). Queries run on worker threads, so a slow controller
never freezes the screen.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.tree import Tree
from textual import work
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Input, Static

WINDOW_US = 5_000_000  # message rates and busy time over the last 5 s of recorded calls
TIMEOUT_S = 10.0       # a query that takes longer is cancelled and reported, and the view tries again later


class Query(Protocol):
    """Runs `sql` on a controller for up to `timeout` s: its JSON answer ({"columns", "rows", "late"} or
    {"error"})."""

    def __call__(self, sql: str, *, timeout: float) -> dict[str, Any]: ...


class Answer(NamedTuple):
    columns: list[str]
    rows: list[list[Any]]
    late: list[str]  # ranks whose newest events were not in yet (busy in a long call)


def run(query: Query, sql: str, timeout: float = TIMEOUT_S) -> Answer:
    """The answer to `sql` from the controller, which runs it for up to `timeout` s; RuntimeError with the
    database's message (QueryTimeout when it ran out of time)."""
    answer = query(sql, timeout=timeout)
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return Answer(answer["columns"], answer["rows"], answer.get("late", []))


def table(columns: list[str], rows: list[list[Any]], title: str = "") -> Table:
    t = Table(title=title or None, show_lines=False)
    for c in columns:
        t.add_column(str(c))
    for r in rows:
        t.add_row(*(str(v) for v in r))
    return t


def mesh_tree(query: Query) -> Tree:
    """Hosts -> procs (mesh, rank, pid, latest event) -> the actors on each proc."""
    procs = run(query, "SELECT arg_max(host, time_us) FILTER (WHERE host <> ''), mesh, rank, arg_max(pid, time_us), "
                "arg_max(event, time_us), arg_max(detail, time_us) FROM procs GROUP BY mesh, rank "
                "ORDER BY mesh, rank").rows
    actors = run(query, "SELECT mesh, rank, string_agg(DISTINCT actor, ', ') FROM actors GROUP BY mesh, rank").rows
    on = {(m, r): a for m, r, a in actors}
    root = Tree("controller")
    hosts: dict[str, Tree] = {}
    for host, mesh, rank, p, event, detail in procs:
        name = host or "?"
        if name not in hosts:
            hosts[name] = root.add(f"host {name}")
        state = "[green]running[/]" if event == "started" else f"[red]{event} {detail}[/]"
        proc = hosts[name].add(f"{mesh} rank {rank}  pid {p}  {state}")
        if (mesh, rank) in on:
            proc.add(f"actors: {on[(mesh, rank)]}")
    return root


def activity(query: Query) -> Table:
    answer = run(query, f"""
        WITH since AS (SELECT max(end_us) - {WINDOW_US} AS t0 FROM messages),
             calls AS (SELECT mesh, rank, count(*) * 1e6 / {WINDOW_US} AS msgs_per_s,
                              round(100.0 * sum(end_us - greatest(start_us, t0)) / {WINDOW_US}, 1) AS busy_pct
                       FROM messages, since WHERE end_us > t0 GROUP BY mesh, rank),
             mem AS (SELECT mesh, rank, arg_max(rss_bytes, time_us) // 1048576 AS rss_mb,
                            arg_max(tensor_bytes, time_us) // 1048576 AS tensor_mb FROM memory GROUP BY mesh, rank)
        SELECT p.mesh, p.rank, coalesce(msgs_per_s, 0) AS msgs_per_s, coalesce(busy_pct, 0) AS busy_pct, rss_mb,
               tensor_mb
        FROM (SELECT DISTINCT mesh, rank FROM procs WHERE rank >= 0) p
             LEFT JOIN calls ON calls.mesh = p.mesh AND calls.rank = p.rank
             LEFT JOIN mem ON mem.mesh = p.mesh AND mem.rank = p.rank ORDER BY p.mesh, p.rank""")
    late = f"; not answering now: {', '.join(answer.late)}" if answer.late else ""
    return table(answer.columns, answer.rows, f"activity per rank (last 5 s of calls; latest memory sample{late})")


def failures(query: Query) -> Table:
    answer = run(query, "SELECT mesh, rank, kind, what, detail FROM failures ORDER BY time_us DESC LIMIT 5")
    return table(answer.columns, answer.rows, "latest failures")


def screen(query: Query) -> RenderableType:
    """The mesh tree, activity and failures (what `--once` prints)."""
    return Group(Panel(mesh_tree(query), title="mesh"), activity(query), failures(query))


class SqlPrompt(Input):
    """A one-line SQL editor with a history of submitted queries (Up and Down)."""

    BINDINGS = [("up", "older", "older query"), ("down", "newer", "newer query")]

    def __init__(self) -> None:
        super().__init__(placeholder="SQL over procs, actors, messages, ops, collectives, memory, logs, failures",
                         id="sql")
        self.history: list[str] = []
        self._at = 0

    def remember(self, sql: str) -> None:
        if not self.history or self.history[-1] != sql:
            self.history.append(sql)
        self._at = len(self.history)

    def action_older(self) -> None:
        self._walk(-1)

    def action_newer(self) -> None:
        self._walk(1)

    def _walk(self, step: int) -> None:
        self._at = max(0, min(len(self.history), self._at + step))
        self.value = self.history[self._at] if self._at < len(self.history) else ""
        self.cursor_position = len(self.value)


class Top(App[None]):
    """The live view of the controller that `query` asks (`title` names it): the three views, redrawn every
    `interval` s; a SQL prompt and its last result."""

    TITLE = "monarch top"
    BINDINGS = [("ctrl+q", "quit", "quit")]
    CSS = "#views, #result { height: auto; } #body { height: 1fr; } #sql { dock: bottom; }"

    def __init__(self, query: Query, title: str, interval: float = 1.0) -> None:
        super().__init__()
        self.ask_sql, self.controller_title, self.interval = query, title, interval

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="body"):
            yield Static(id="views")
            yield Static(id="result")
        yield SqlPrompt()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.controller_title
        self.redraw()
        self.set_interval(self.interval, self.redraw)
        self.query_one(SqlPrompt).focus()

    @work(thread=True, exclusive=True, group="views")
    def redraw(self) -> None:
        try:
            shown = screen(self.ask_sql)
        except (RuntimeError, OSError) as e:
            shown = f"[red]the controller does not answer: {e}[/]"
        self.call_from_thread(self.query_one("#views", Static).update, shown)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        sql = event.value.strip()
        if sql:
            self.query_one(SqlPrompt).remember(sql)
            self.query_one(SqlPrompt).value = ""
            self.answer(sql)

    @work(thread=True, exclusive=True, group="sql")
    def answer(self, sql: str) -> None:
        try:
            answer = run(self.ask_sql, sql)
            shown: RenderableType = Panel(table(answer.columns, answer.rows), title=sql)
        except (RuntimeError, OSError) as e:
            shown = Panel(f"[red]{e}[/]", title=sql)
        self.call_from_thread(self.query_one("#result", Static).update, shown)
