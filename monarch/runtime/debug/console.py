"""The `monarch_dbg>` console over the paused ranks (the controller's record of them: control/handlers/breakpoints.py),
with Monarch's commands; and `debug_controller()`.

`monarch debug` (another terminal) runs a DebugConsole in the controller through its admin socket (admin.py);
`debug_controller()` drives one from the controller's own process (tests, notebooks). Commands: list, attach
<actor> <rank> (then pdb lines go to that rank; `detach` comes back), cast <actor> ranks(...) <pdb command>,
continue (every paused rank clears its breakpoints and continues), help, quit.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from monarch.errors import MonarchError
from monarch.runtime.control.handlers.breakpoints import BREAKPOINTS, Breakpoints, PausedRank
from monarch.runtime.control.futures import CallState, Future, one_result
from monarch.shape import Shape

PROMPT = "monarch_dbg> "
BANNER = ("\n************************ MONARCH DEBUGGER ************************\n"
          "Enter 'help' for a list of commands.\nEnter 'list' to show all active breakpoints.\n\n")
HELP = """monarch_dbg commands:
\tattach <actor_name> <rank> - attach to a debug session (`attach <rank>` when one actor has that rank)
\tlist - list all debug sessions
\tquit - exit the debugger, leaving all sessions in place
\tcast <actor_name> ranks(...) <command> - send a pdb command to a set of ranks of that actor mesh:
\t\tranks(1), ranks(1,4,6), ranks(start?:stop?:step?) or by dims, ranks(dp=0:2, tp=(0,1));
\t\twithout the actor name: every actor paused on those ranks (`cast 0,1 n` is short for `cast ranks(0,1) n`)
\tcontinue - clear all breakpoints and tell all ranks to continue
\thelp - print this help message
"""
WAIT_S = 30.0  # how long a console waits for a rank to answer a line before it leaves it running
_CAST = re.compile(r"cast\s+(?:(?P<actor>[-\w]+)\s+)?(?:ranks\((?P<ranks>.*?)\)|(?P<bare>[\d,:]+))\s+(?P<command>\S.*)")


class DebugError(MonarchError):
    """A console command that cannot run: no such paused rank, a bad rank selection."""


@dataclass(frozen=True)
class DebugSessionInfo:
    """One row of `list`, with Monarch's fields (function: `module.function`), plus the mesh, the endpoint
    and the file."""
    actor_name: str
    rank: int
    coords: dict[str, int]
    hostname: str
    function: str
    lineno: int
    mesh: str = ""
    endpoint: str = ""
    filename: str = ""


def info(rec: PausedRank) -> DebugSessionInfo:
    coords = point(rec)
    module = os.path.splitext(os.path.basename(rec.at.filename))[0]
    return DebugSessionInfo(rec.actor, rec.rank, coords, rec.at.host, f"{module}.{rec.at.function}", rec.at.lineno,
                            rec.mesh.name, rec.at.endpoint, rec.at.filename)


def point(rec: PausedRank) -> dict[str, int]:
    """A paused rank's coordinates by dim (its label is "dp=0,tp=1")."""
    return {k: int(v) for k, v in (kv.split("=") for kv in rec.at.coords.split(",") if "=" in kv)}


def table(rows: list[DebugSessionInfo]) -> str:
    """The paused ranks as a text table: Monarch's columns, then the mesh and the endpoint."""
    if not rows:
        return "no rank is paused at a breakpoint\n"
    head = ("Actor Name", "Rank", "Coords", "Hostname", "Function", "Line No.", "Mesh", "Endpoint")
    body = [(r.actor_name, str(r.rank), str(r.coords), r.hostname, r.function, str(r.lineno), r.mesh, r.endpoint)
            for r in rows]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]]) + "\n"


def _indices(spec: str, size: int) -> list[int]:
    """`3`, `1,4,6` or `start?:stop?:step?` as the ints they name (a range stops at `size`)."""
    spec = spec.strip().strip("()")
    try:
        if ":" in spec:
            parts = [int(p) if p.strip() else None for p in spec.split(":")]
            return list(range(size)[slice(*parts)])
        return [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise DebugError(f"bad rank selection {spec!r}: use 3, 1,4,6 or start:stop:step") from None


def _split(spec: str) -> list[str]:
    """`dp=0:2, tp=(0,1)` split at the commas outside parentheses."""
    items, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items, cur = [*items, cur], ""
        else:
            cur += ch
    return [i.strip() for i in [*items, cur] if i.strip()]


def select(recs: list[PausedRank], spec: str) -> list[PausedRank]:
    """The paused ranks that `ranks(<spec>)` names: ranks, a range of ranks, or coordinates by dim."""
    items = _split(spec)
    if not any("=" in i for i in items):
        wanted = set(_indices(spec, 1 + max((r.rank for r in recs), default=0)))
        return [r for r in recs if r.rank in wanted]
    if not all("=" in i for i in items):
        raise DebugError(f"bad rank selection {spec!r}: give every dim a value, as in ranks(dp=0:2, tp=1)")
    dims = [(d.strip(), v) for d, v in (i.split("=", 1) for i in items)]
    chosen = []
    for rec in recs:
        coords = point(rec)
        if all(d in coords and coords[d] in _indices(v, 1 + coords[d]) for d, v in dims):
            chosen.append(rec)
    return chosen


class DebugConsole:
    """One user's `monarch_dbg>` session: lines in, text out; attached to at most one paused rank."""

    def __init__(self, breakpoints: Breakpoints = BREAKPOINTS, wait_s: float = WAIT_S) -> None:
        self.breakpoints, self.wait_s = breakpoints, wait_s
        self.attached: PausedRank | None = None
        self.done = False

    @property
    def prompt(self) -> str:
        return "" if self.attached is not None else PROMPT  # an attached rank's output ends with its (Pdb) prompt

    def handle(self, line: str) -> str:
        """Run one line: a console command, or a pdb line for the attached rank; what to show for it."""
        try:
            return self._pdb_line(line) if self.attached is not None else self._command(line.strip())
        except DebugError as e:
            return f"{e}\n"

    def _command(self, line: str) -> str:
        word, _, rest = line.partition(" ")
        if not line:
            return ""
        if word in ("h", "help"):
            return HELP
        if word in ("l", "list"):
            return table([info(r) for r in self.breakpoints.ranks()])
        if word in ("a", "attach"):
            return self._attach(rest.split())
        if word == "cast":
            return self._cast(line)
        if word in ("c", "continue"):
            return self._continue()
        if word in ("q", "quit"):
            self.done = True
            return "Quitting debug session (paused ranks stay paused)...\n"
        raise DebugError(f"unknown command {line!r}; enter 'help' for the commands")

    def _attach(self, args: list[str]) -> str:
        if not args or len(args) > 2 or not args[-1].isdigit():
            raise DebugError("usage: attach <actor_name> <rank>")
        actor = args[0] if len(args) == 2 else None
        found = self.breakpoints.find(actor, int(args[-1]))
        if len(found) != 1:
            which = f"{actor} {args[-1]}" if actor else f"rank {args[-1]}"
            raise DebugError(f"no paused rank {which}; `list` shows them" if not found else
                             f"rank {args[-1]} is paused in {len(found)} actors "
                             f"({', '.join(f'{r.actor} of mesh {r.mesh.name!r}' for r in found)}): name the actor, "
                             "`attach <actor_name> <rank>`")
        self.attached = rec = found[0]
        shown = self.breakpoints.take_output(rec)  # what it printed since its last line, shown once
        note = f"<last pdb output for {rec.actor} {rec.rank} follows>\n" if shown else ""
        return f"Attached to debug session for {rec.actor} {rec.rank} ({rec.at.host})\n{note}{shown}"

    def _pdb_line(self, line: str) -> str:
        rec = self.attached
        assert rec is not None
        if line.strip() == "detach":
            return self._detach("")
        if rec.ended:
            return self._detach(self.breakpoints.take_output(rec))
        late = self.breakpoints.send([rec], line, self.wait_s)
        out = self.breakpoints.take_output(rec)
        if late:
            return self._detach(out + f"(rank {rec.rank} is still running {line!r} after {self.wait_s} s; `list` "
                                      "shows it when it pauses again)\n")
        return self._detach(out) if rec.ended else out

    def _detach(self, out: str) -> str:
        rec, self.attached = self.attached, None
        assert rec is not None
        return f"{out}Detached from debug session for {rec.actor} {rec.rank} ({rec.at.host})\n"

    def _cast(self, line: str) -> str:
        m = _CAST.fullmatch(line)
        if m is None:
            raise DebugError("usage: cast <actor_name> ranks(<ranks>) <pdb command>, or cast <ranks> <pdb command>")
        recs = [r for r in self.breakpoints.ranks() if m["actor"] in (None, r.actor)]
        chosen = select(recs, m["ranks"] if m["ranks"] is not None else m["bare"])
        if not chosen:
            raise DebugError(f"no paused rank matches {line!r}; `list` shows them")
        return self._run_all(chosen, m["command"].strip(), False)

    def _continue(self) -> str:
        recs = self.breakpoints.ranks()
        return self._run_all(recs, "continue", True) + f"continued {len(recs)} paused rank(s)\n"

    def _run_all(self, recs: list[PausedRank], line: str, resume: bool) -> str:
        """Send every rank of `recs` the line at once; their answers, each under its actor and rank."""
        late = self.breakpoints.send(recs, line, self.wait_s, resume)
        parts = []
        for rec in recs:
            out = self.breakpoints.take_output(rec)
            tail = " still running" if rec in late else (" continued" if rec.ended else "")
            parts.append(f"[{rec.actor} {rec.rank}{tail}]\n{out}" + ("" if not out or out.endswith("\n") else "\n"))
        return "".join(parts)


R = TypeVar("R")


class LocalEndpoint(Generic[R]):
    """A method of DebugController that is also called as Monarch calls its actor's endpoints:
    `debug_controller().list.call_one(print_output=False).get()` (or `await`) runs it here, now."""

    def __init__(self, fn: Callable[..., R]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type) -> Any:
        return self if obj is None else BoundEndpoint(self.fn, obj)


class BoundEndpoint(Generic[R]):
    def __init__(self, fn: Callable[..., R], obj: Any) -> None:
        self.fn, self.obj = fn, obj

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self.fn(self.obj, *args, **kwargs)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Run it now; a Future that is done already."""
        state = CallState(Shape.row_major((), ()), f"debug_controller().{self.fn.__name__}")
        state.deliver(0, True, self(*args, **kwargs))
        return Future(state, _DONE, one_result)


class _Done:
    """The waiter of a Future that is done already: nothing to wait for."""
    threaded = False

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        assert state.done, "a local endpoint's future is done when it is made"


_DONE = _Done()


class DebugController:
    """The debugger of this controller's process, driven from Python: Monarch's `debug_controller()`.

    `list()` returns the paused ranks, `wait_pending_session()` waits for them, `enter()` runs the prompt on
    this terminal, and `run(line)` runs one `monarch_dbg>` line (list, attach, pdb lines while attached,
    detach, cast, continue) and returns its text. The first three also take Monarch's `.call_one(...).get()`.
    """

    def __init__(self, breakpoints: Breakpoints = BREAKPOINTS) -> None:
        self.console = DebugConsole(breakpoints)

    @LocalEndpoint
    def list(self, print_output: bool = True) -> list[DebugSessionInfo]:
        rows = [info(r) for r in self.console.breakpoints.ranks()]
        if print_output:
            print(table(rows), end="")
        return rows

    @LocalEndpoint
    def wait_pending_session(self, count: int = 1, timeout: float = 30.0) -> list[DebugSessionInfo]:
        """Wait until `count` ranks are paused (DebugError after `timeout` s); their rows."""
        recs = self.console.breakpoints.wait_for(count, timeout)
        if len([r for r in recs if r.waiting]) < count:
            raise DebugError(f"{len(recs)} rank(s) paused at a breakpoint within {timeout} s, not {count}")
        return [info(r) for r in recs]

    def run(self, line: str, timeout: float = WAIT_S) -> str:
        self.console.wait_s = timeout
        return self.console.handle(line)

    @LocalEndpoint
    def enter(self) -> None:
        """The `monarch_dbg>` prompt on this process's terminal, until quit (Monarch's `enter`)."""
        print(BANNER, end="")
        while not self.console.done:
            try:
                line = input(self.console.prompt)
            except EOFError:
                line = "detach" if self.console.attached is not None else "quit"
            print(self.console.handle(line), end="", flush=True)
        self.console.done = False  # the next enter() starts again


def debug_controller() -> DebugController:
    """A debugger console over the ranks paused in this process's meshes."""
    return DebugController()
