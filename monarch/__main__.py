"""`python -m monarch` (also the `monarch` command): look into a running controller from a terminal.

  monarch query "SELECT ..."      run SQL over its telemetry and print a table
  monarch top [--once]            a live view: hosts, procs and actors, message rates, busy time,
                                  memory, the latest failures; type SQL and Enter to run it
Both attach to the newest controller of this user on this machine (or `--pid`), see runtime/admin.py.
"""
from __future__ import annotations

import argparse
import select
import sys
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.tree import Tree

from monarch.runtime.admin import query

WINDOW_US = 5_000_000  # message rates and busy time over the last 5 s of recorded calls


def run(sql: str, pid: int | None) -> tuple[list[str], list[list[Any]]]:
    answer = query(sql, pid)
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer["columns"], answer["rows"]


def table(columns: list[str], rows: list[list[Any]], title: str = "") -> Table:
    t = Table(title=title or None, show_lines=False)
    for c in columns:
        t.add_column(str(c))
    for r in rows:
        t.add_row(*(str(v) for v in r))
    return t


def mesh_tree(pid: int | None) -> Tree:
    """Hosts -> procs (mesh, rank, pid, latest event) -> the actors on each proc."""
    _, procs = run("SELECT arg_max(host, time_us) FILTER (WHERE host <> ''), mesh, rank, arg_max(pid, time_us), "
                   "arg_max(event, time_us), arg_max(detail, time_us) FROM procs GROUP BY mesh, rank "
                   "ORDER BY mesh, rank", pid)
    _, actors = run("SELECT mesh, rank, string_agg(DISTINCT actor, ', ') FROM actors GROUP BY mesh, rank", pid)
    on = {(m, r): a for m, r, a in actors}
    root = Tree("controller")
    hosts: dict[str, Tree] = {}
    for host, mesh, rank, p, event, detail in procs:
        name = host or "?"
        if name not in hosts:
            hosts[name] = root.add(f"host {name}")
        node = hosts[name]
        state = "[green]running[/]" if event == "started" else f"[red]{event} {detail}[/]"
        proc = node.add(f"{mesh} rank {rank}  pid {p}  {state}")
        if (mesh, rank) in on:
            proc.add(f"actors: {on[(mesh, rank)]}")
    return root


def activity(pid: int | None) -> Table:
    cols, rows = run(f"""
        WITH recent AS (SELECT * FROM messages WHERE end_us > (SELECT max(end_us) FROM messages) - {WINDOW_US}),
             calls AS (SELECT mesh, rank, count(*) * 1e6 / {WINDOW_US} AS msgs_per_s,
                              round(100.0 * sum(end_us - start_us) / {WINDOW_US}, 1) AS busy_pct
                       FROM recent GROUP BY mesh, rank),
             mem AS (SELECT mesh, rank, arg_max(rss_bytes, time_us) // 1048576 AS rss_mb,
                            arg_max(tensor_bytes, time_us) // 1048576 AS tensor_mb FROM memory GROUP BY mesh, rank)
        SELECT coalesce(calls.mesh, mem.mesh) AS mesh, coalesce(calls.rank, mem.rank) AS rank, msgs_per_s,
               busy_pct, rss_mb, tensor_mb
        FROM calls FULL OUTER JOIN mem ON calls.mesh = mem.mesh AND calls.rank = mem.rank ORDER BY mesh, rank""",
                     pid)
    return table(cols, rows, "activity per rank (last 5 s of calls; latest memory sample)")


def failures(pid: int | None) -> Table:
    cols, rows = run("SELECT mesh, rank, kind, what, detail FROM failures ORDER BY time_us DESC LIMIT 5", pid)
    return table(cols, rows, "latest failures")


def screen(pid: int | None, custom: Any) -> Group:
    parts: list[Any] = [Panel(mesh_tree(pid), title="mesh"), activity(pid), failures(pid)]
    if custom is not None:
        parts.append(Panel(custom, title="your query"))
    parts.append("type SQL and press Enter to run it; Ctrl-C quits")
    return Group(*parts)


def top(pid: int | None, once: bool, interval: float) -> None:
    console = Console()
    if once:
        console.print(screen(pid, None))
        return
    custom: Any = None
    with Live(screen(pid, custom), console=console, refresh_per_second=4) as live:
        while True:
            ready = select.select([sys.stdin], [], [], interval)[0]
            if ready:
                line = sys.stdin.readline().strip()
                if line:
                    try:
                        custom = table(*run(line, pid))
                    except (RuntimeError, ConnectionError) as e:
                        custom = f"[red]{e}[/]"
            live.update(screen(pid, custom))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query", help="run SQL over a controller's telemetry")
    q.add_argument("sql")
    t = sub.add_parser("top", help="a live view of a controller's meshes")
    t.add_argument("--once", action="store_true", help="print one screen and exit")
    t.add_argument("--interval", type=float, default=1.0)
    for s in (q, t):
        s.add_argument("--pid", type=int, help="the controller's pid (default: the newest)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "query":
            Console().print(table(*run(a.sql, a.pid)))
        else:
            top(a.pid, a.once, a.interval)
    except (RuntimeError, ConnectionError) as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
