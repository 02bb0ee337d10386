"""`monarch query` and `monarch top` attached to a real running controller (another process)."""
from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from processes import run_script
from rich.console import Console
from textual.widgets import Static

from monarch.runtime.debug.admin import TOKEN_BYTES, announce_dir, query, recv_json, send_json
from monarch.runtime.telemetry.top import SqlPrompt, Top

T = 60


@pytest.fixture(scope="module")
def controller_pid() -> Iterator[int]:
    child = run_script("""
        import time
        from monarch.actor import Actor, endpoint, this_host

        class Echo(Actor):
            @endpoint
            def ping(self, x: int) -> int:
                return x

        procs = this_host().spawn_procs(per_host={"dp": 2, "tp": 2})
        echo = procs.spawn("cli_echo", Echo)
        for i in range(250):
            echo.ping.call(i).get(timeout=30)
        print("up", flush=True)
        time.sleep(120)
    """)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        yield child.pid
    finally:
        child.terminate()
        child.wait(timeout=T)


def monarch_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monarch", *args], capture_output=True, text=True, timeout=T,
                          env={**os.environ, "COLUMNS": "120"})


def test_query_prints_a_table(controller_pid: int) -> None:
    out = monarch_cli("query", "--pid", str(controller_pid), "SELECT rank, count(*) AS calls FROM messages "
                      "WHERE actor = 'cli_echo' GROUP BY rank ORDER BY rank")
    assert out.returncode == 0, out.stderr
    assert "calls" in out.stdout and out.stdout.count("250") == 4


def test_the_monarch_command_is_installed(controller_pid: int) -> None:
    """setup.cfg declares the `monarch` console script; the installed script runs `--help` and a query."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parents[3] / "setup.cfg")
    assert "monarch = monarch.__main__:main" in cfg.get("options.entry_points", "console_scripts", fallback="")
    script = Path(sys.executable).parent / "monarch"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=T)
    assert out.returncode == 0 and "monarch query" in out.stdout, out.stderr
    out = subprocess.run([str(script), "query", "--pid", str(controller_pid), "SELECT 6 * 7 AS answer"],
                         capture_output=True, text=True, timeout=T, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0 and "42" in out.stdout, out.stderr


def test_query_errors_are_reported(controller_pid: int) -> None:
    out = monarch_cli("query", "--pid", str(controller_pid), "SELEC nothing")
    assert out.returncode == 1 and "Parser Error" in out.stderr


def test_top_renders_the_mesh_headless(controller_pid: int) -> None:
    out = monarch_cli("top", "--once", "--pid", str(controller_pid))
    assert out.returncode == 0, out.stderr
    for rank in range(4):
        assert f"procs rank {rank}" in out.stdout
    assert "actors: cli_echo" in out.stdout and "msgs_per_s" in out.stdout and "latest failures" in out.stdout


def rendered(app: Any, selector: str) -> str:
    """The text a Static of the app shows."""
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(app.query_one(selector, Static).content)
    return console.export_text()


async def shown(pilot: Any, selector: str, text: str) -> str:
    deadline = time.monotonic() + T
    while text not in (out := rendered(pilot.app, selector)):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {selector}:\n{out}"
        await pilot.pause(0.05)
    return out


def test_top_app_shows_the_ranks_and_runs_typed_sql(controller_pid: int) -> None:
    async def drive() -> None:
        app = Top(partial(query, pid=controller_pid), f"controller {controller_pid}", interval=0.2)
        async with app.run_test(size=(140, 50)) as pilot:
            views = await shown(pilot, "#views", "actors: cli_echo")
            assert all(f"procs rank {rank}" in views for rank in range(4)) and "msgs_per_s" in views
            await pilot.press(*"SELECT count(*) AS calls FROM messages WHERE actor = 'cli_echo'", "enter")
            assert "1000" in await shown(pilot, "#result", "calls")
            await pilot.press(*"SELEC oops", "enter")
            await shown(pilot, "#result", "Parser Error")
            prompt = app.query_one(SqlPrompt)
            await pilot.press("up", "up")
            assert prompt.value == "SELECT count(*) AS calls FROM messages WHERE actor = 'cli_echo'"
            await pilot.press("down", "down")
            assert prompt.value == ""
    asyncio.run(drive())


def test_admin_endpoint_needs_the_token(controller_pid: int) -> None:
    info = json.loads((announce_dir() / f"controller-{controller_pid}.json").read_text())
    assert (announce_dir() / f"controller-{controller_pid}.json").stat().st_mode & 0o077 == 0
    with socket.create_connection(("127.0.0.1", info["port"]), timeout=10) as sock:
        sock.sendall(b"\0" * TOKEN_BYTES)
        send_json(sock, {"sql": "SELECT 1"})
        time.sleep(0.2)
        with pytest.raises(ConnectionError):
            recv_json(sock)
    with socket.create_connection(("127.0.0.1", info["port"]), timeout=10) as sock:
        sock.sendall(bytes.fromhex(info["token"]))
        send_json(sock, {"sql": "SELECT 41 + 1"})
        assert recv_json(sock) == {"columns": ["(41 + 1)"], "rows": [[42]], "late": []}
