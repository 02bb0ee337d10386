"""breakpoint() in an endpoint on real workers: the rank pauses in a pdb relayed to the controller, and the
`monarch_dbg>` console (debug_controller(), `monarch debug`) lists, attaches, casts and continues."""
from __future__ import annotations

import inspect
import os
import pdb
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch.actor import (Actor, ActorError, ActorMesh, ProcMesh, SupervisionError, current_rank, debug_controller,
                           endpoint, this_host)

T = 30  # seconds: generous bound for every wait
ROOT = Path(__file__).resolve().parents[3]


class Debugee(Actor):
    @endpoint
    def to_debug(self, base: int) -> int:
        x = base + current_rank()["dp"]
        y = x * 10
        breakpoint()  # noqa: T100 - what the test is about
        y = y + 1
        z = y + 1
        return z

    @endpoint
    def short(self, a: int) -> int:
        breakpoint()  # noqa: T100
        b = a + 1
        return b

    @endpoint
    def loop(self, n: int) -> int:
        total = 0
        breakpoint()  # noqa: T100
        for i in range(n):
            total += i  # the test sets a breakpoint here
        return total

    @endpoint
    def ping(self) -> int:
        return current_rank()["dp"]


class Traced(Actor):
    @endpoint
    async def traced(self, v: str) -> str:
        w = v.upper()
        pdb.set_trace()  # noqa: T100
        return w + "!"


def _line_of(text: str) -> int:
    """The line of Debugee's source that holds `text` first."""
    lines, start = inspect.getsourcelines(Debugee)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _pause_line() -> int:
    """The line a rank pauses at in to_debug: the one after its breakpoint()."""
    return _line_of("breakpoint()") + 1


@pytest.fixture(scope="module")
def procs() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"dp": 2}, name="debuggees") as p:
        yield p


@pytest.fixture(scope="module")
def debugee(procs: ProcMesh) -> ActorMesh:
    return procs.spawn("debugee", Debugee)


def test_list_attach_cast_continue(debugee: ActorMesh, capsys: pytest.CaptureFixture[str]) -> None:
    fut = debugee.to_debug.call(7)
    dc = debug_controller()
    rows = dc.wait_pending_session(2, timeout=T)
    notice = capsys.readouterr().err  # one line for the actor mesh, naming its first paused rank
    assert notice.count("is paused in pdb") == 1 and "`monarch debug`" in notice, notice
    fn = "test_relay.to_debug"
    assert [(r.actor_name, r.rank, r.coords, r.function, r.lineno) for r in rows] == [
        ("debugee", 0, {"dp": 0}, fn, _pause_line()), ("debugee", 1, {"dp": 1}, fn, _pause_line())]
    assert rows[0].endpoint == "to_debug" and rows[0].mesh == "debuggees" and rows[0].hostname == os.uname().nodename
    assert rows[0].filename == __file__
    assert dc.list.call_one(print_output=False).get(timeout=T) == rows  # Monarch's way to call it

    out = dc.run("attach debugee 1", timeout=T)
    assert out.startswith("Attached to debug session for debugee 1") and "-> y = y + 1" in out, out
    assert dc.run("p y", timeout=T) == "80\n(Pdb) "  # rank 1's local: (7 + 1) * 10
    assert dc.run("p x * 3", timeout=T) == "24\n(Pdb) "
    assert "Detached from debug session for debugee 1" in dc.run("detach", timeout=T)

    out = dc.run("cast 0,1 n", timeout=T)  # short for `cast ranks(0,1) n`: every actor paused on those ranks
    assert "[debugee 0]" in out and "[debugee 1]" in out and out.count("-> z = y + 1") == 2, out
    assert [r.lineno for r in dc.list(print_output=False)] == [_pause_line() + 1] * 2
    out = dc.run("cast ranks(dp=0) p y", timeout=T)  # by coordinates, actor name left out
    assert "[debugee 0]\n71\n" in out and "[debugee 1]" not in out, out

    assert not fut.done()
    assert "continued 2 paused rank(s)" in dc.run("continue", timeout=T)
    assert fut.get(timeout=T).values() == [72, 82]
    assert dc.list(print_output=False) == []
    assert debugee.ping.call().get(timeout=T).values() == [0, 1]  # the ranks serve calls again


def test_a_timeout_says_a_breakpoint_is_waiting(debugee: ActorMesh, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    fut = debugee.to_debug.call(0)
    dc = debug_controller()
    dc.wait_pending_session(2, timeout=T)
    with pytest.raises(TimeoutError, match="breakpoint is waiting on rank 0, 1") as err:
        fut.get(timeout=0.5)
    assert "monarch debug" in str(err.value) and "attach debugee 0" in str(err.value)
    later = debugee.ping.call()  # queued behind the paused call on both ranks
    with pytest.raises(TimeoutError, match="breakpoint is waiting"):
        later.get(timeout=0.5)
    lines = iter(["list", "continue", "quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))  # enter() reads this terminal
    dc.enter()
    out = capsys.readouterr().out
    assert "MONARCH DEBUGGER" in out and out.count("to_debug") == 4 and "continued 2 paused rank(s)" in out, out
    assert fut.get(timeout=T).values() == [2, 12]
    assert later.get(timeout=T).values() == [0, 1]


def test_pdb_set_trace_in_an_async_endpoint_and_quit(procs: ProcMesh) -> None:
    one = procs.spawn("traced", Traced).slice(dp=1)
    dc = debug_controller()
    fut = one.traced.call_one("ok")
    dc.wait_pending_session(1, timeout=T)
    dc.run("attach 1", timeout=T)  # the rank alone names the session when one actor has it
    assert dc.run("p w", timeout=T) == "'OK'\n(Pdb) "
    assert "Detached" in dc.run("c", timeout=T)  # continue without breakpoints ends the session
    assert fut.get(timeout=T) == "OK!"

    fut = one.traced.call_one("no")
    dc.wait_pending_session(1, timeout=T)
    dc.run("attach traced 1", timeout=T)
    dc.run("q", timeout=T)
    with pytest.raises(ActorError, match="BdbQuit"):
        fut.get(timeout=T)
    assert dc.list(print_output=False) == []


def test_stepping_off_the_end_of_the_endpoint_ends_the_session(debugee: ActorMesh) -> None:
    rank0 = debugee.slice(dp=0)
    dc = debug_controller()
    fut = rank0.short.call_one(1)
    dc.wait_pending_session(1, timeout=T)
    assert "-> b = a + 1" in dc.run("attach debugee 0", timeout=T)
    assert "-> return b" in dc.run("n", timeout=T)
    assert "--Return--" in dc.run("n", timeout=T)
    assert dc.run("n", timeout=T).endswith("Detached from debug session for debugee 0 (%s)\n" % os.uname().nodename)
    assert fut.get(timeout=T) == 2
    assert rank0.ping.call_one().get(timeout=T) == 0  # the next call runs: pdb does not step into it
    assert dc.list(print_output=False) == []


def test_a_breakpoint_set_in_pdb_stops_again_and_continue_clears_it(debugee: ActorMesh) -> None:
    rank1 = debugee.slice(dp=1)
    dc = debug_controller()
    fut = rank1.loop.call_one(4)
    dc.wait_pending_session(1, timeout=T)
    dc.run("attach debugee 1", timeout=T)
    inner = _line_of("total += i")
    assert "Breakpoint 1 at " in dc.run(f"b {inner}", timeout=T)
    assert f"({inner})loop()" in dc.run("c", timeout=T)  # still attached: it stopped at the new breakpoint
    assert dc.run("p i, total", timeout=T) == "(0, 0)\n(Pdb) "
    assert f"({inner})loop()" in dc.run("c", timeout=T)
    assert dc.run("p i", timeout=T) == "1\n(Pdb) "
    assert [r.lineno for r in dc.list(print_output=False)] == [inner]
    dc.run("detach", timeout=T)
    dc.run("continue", timeout=T)  # clears the breakpoint: the loop runs to its end
    assert fut.get(timeout=T) == 6
    assert dc.list(print_output=False) == []


def test_a_paused_rank_keeps_beating_and_stopping_its_mesh_does_not_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_HEARTBEAT_TIMEOUT", "1")
    dc = debug_controller()
    with this_host().spawn_procs(per_host={"dp": 1}, name="stopped") as procs:
        fut = procs.spawn("debugee", Debugee).to_debug.call_one(1)
        dc.wait_pending_session(1, timeout=T)
        time.sleep(2.0)  # twice the heartbeat timeout: a paused rank is not a silent one
        assert procs.running and [r.mesh for r in dc.list(print_output=False)] == ["stopped"]
        start = time.monotonic()
    assert time.monotonic() - start < 5  # the paused rank read EOF, quit pdb and stopped like the others
    with pytest.raises((ActorError, SupervisionError)):  # BdbQuit, or the stop that failed it first
        fut.get(timeout=T)
    assert dc.list(print_output=False) == []


def test_pythonbreakpoint_0_turns_breakpoints_off() -> None:
    with this_host().spawn_procs(per_host={"dp": 1}, name="nobreak", env={"PYTHONBREAKPOINT": "0"}) as procs:
        assert procs.spawn("debugee", Debugee).to_debug.call_one(1).get(timeout=T) == 12


def _monarch_debug(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monarch", "debug", "--pid", str(os.getpid())], input=stdin,
                          capture_output=True, text=True, timeout=T)


def test_the_monarch_debug_command(debugee: ActorMesh) -> None:
    fut = debugee.to_debug.call(100)
    debug_controller().wait_pending_session(2, timeout=T)
    out = _monarch_debug("list\nquit\n")
    assert out.returncode == 0, out.stderr
    assert "MONARCH DEBUGGER" in out.stdout and "monarch_dbg> " in out.stdout
    rows = [[c.strip() for c in line.split("|")] for line in out.stdout.splitlines() if line.startswith("debugee")]
    fn, line = "test_relay.to_debug", str(_pause_line())
    assert [(r[0], r[1], r[2], r[4], r[5], r[7]) for r in rows] == [
        ("debugee", "0", "{'dp': 0}", fn, line, "to_debug"), ("debugee", "1", "{'dp': 1}", fn, line, "to_debug")]

    out = _monarch_debug("attach debugee 0\np y\ndetach\nlist\n")  # EOF at the prompt quits
    assert out.returncode == 0, out.stderr
    assert "Attached to debug session for debugee 0" in out.stdout, out.stdout
    assert "(Pdb) 1000\n(Pdb) " in out.stdout, out.stdout  # stdin is no terminal: the line is not echoed
    assert "Detached from debug session for debugee 0" in out.stdout
    out = _monarch_debug("attach nobody 5\ncontinue\n")
    assert "no paused rank nobody 5" in out.stdout and "continued 2 paused rank(s)" in out.stdout, out.stdout
    assert fut.get(timeout=T).values() == [1002, 1012]


MAIN_ACTOR = '''
from monarch.actor import Actor, ActorError, debug_controller, endpoint, this_host

class Main(Actor):
    @endpoint
    def fail(self) -> None:
        raise ValueError("raised in a class of __main__")

    @endpoint
    def pause(self) -> int:
        breakpoint()  # paused in a class of __main__
        return 1

procs = this_host().spawn_procs(per_host={"dp": 1})
main = procs.spawn("main", Main)
try:
    main.fail.call_one().get(timeout=30)
except ActorError as e:
    print("TRACEBACK", e.remote_traceback)
fut = main.pause.call_one()
dc = debug_controller()
dc.wait_pending_session(1, timeout=30)
print("LISTING", dc.run("attach main 0", timeout=30), dc.run("l", timeout=30))
dc.run("continue", timeout=30)
print("RESULT", fut.get(timeout=30))
procs.stop()
'''
IN_A_CELL = "from IPython.core.interactiveshell import InteractiveShell\nInteractiveShell.instance().run_cell({!r})\n"


@pytest.mark.parametrize("where", ["script", "notebook cell"])
def test_tracebacks_and_pdb_show_the_source_of_a_main_class(tmp_path: Path, where: str) -> None:
    """A class of `__main__` (a script, or a notebook cell) travels by value: its source comes along, so
    remote tracebacks and pdb on the workers show its lines (not `<dynamic-code>`, not `[EOF]`)."""
    script = tmp_path / "client.py"
    script.write_text(MAIN_ACTOR if where == "script" else IN_A_CELL.format(MAIN_ACTOR))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert "RESULT 1" in out, (out[-3000:], done.stderr[-3000:])
    traceback, listing = out.split("TRACEBACK", 1)[1].split("LISTING", 1)
    assert 'raise ValueError("raised in a class of __main__")' in traceback and "<dynamic-code>" not in traceback, \
        traceback
    assert "breakpoint()  # paused in a class of __main__" in listing and "[EOF]" not in listing, listing
