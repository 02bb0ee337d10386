"""`python -m monarch` (also the `monarch` command): look into a running controller from a terminal.

  monarch query "SELECT ..."      run SQL over its telemetry and print a table
  monarch top [--once]            a live view: hosts, procs and actors, message rates, busy time,
                                  memory, the latest failures, and a SQL prompt (runtime/telemetry/top.py)
Both attach to the newest controller of this user on this machine (or `--pid`), see runtime/admin.py.
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console


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
    from monarch.runtime.telemetry import top
    try:
        if a.cmd == "query":
            answer = top.run(a.sql, a.pid)
            Console().print(top.table(answer.columns, answer.rows))
            if answer.late:
                print(f"monarch: no events yet from {', '.join(answer.late)} (busy?)", file=sys.stderr)
        elif a.once:
            Console().print(top.screen(a.pid))
        else:
            top.Top(a.pid, a.interval).run()
    except (RuntimeError, ConnectionError) as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
