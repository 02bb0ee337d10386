"""Telemetry SQL is read-only, and the admin endpoint serves its clients concurrently.

Every statement that would read a file, write one, change a setting, load an extension or change a
table is refused with QueryRefused, through `monarch.sql` and through the admin endpoint (`admin.query`
and a real `monarch query`), and the tables work afterwards. Slow or idle unauthenticated connections
are dropped after TOKEN_DEADLINE_S and never hold up a real query.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import monarch
from monarch.actor import Actor, ProcMesh, endpoint
from monarch.runtime.telemetry import admin
from monarch.runtime.telemetry.events import Events
from monarch.runtime.telemetry.store import QueryRefused, Store

T = 30.0
READS = ["SELECT count(*) FROM memory", "WITH x AS (SELECT 1 AS a) SELECT a FROM x", "DESCRIBE messages",
         "SHOW TABLES", "SUMMARIZE memory", "EXPLAIN SELECT * FROM messages", "VALUES (1)",
         "EXPLAIN ANALYZE SELECT count(*) FROM messages", "FROM messages LIMIT 1"]


def attacks(tmp: Path) -> list[str]:
    """The statements the outside probe used, and their relatives; none may run."""
    return [f"COPY memory TO '{tmp}/copied.csv'", f"ATTACH '{tmp}/attached.db' AS evil",
            f"EXPORT DATABASE '{tmp}/exported'", f"EXPLAIN ANALYZE COPY memory TO '{tmp}/explained.csv'",
            "SET threads = 1", "RESET lock_configuration", "PRAGMA threads = 1", "LOAD httpfs", "INSTALL httpfs",
            "DROP TABLE memory", "SELECT 1; DROP TABLE memory", "EXPLAIN ANALYZE DROP TABLE memory",
            "CREATE TABLE evil (a INTEGER)", "INSERT INTO memory SELECT * FROM memory", "UPDATE memory SET rank = 9",
            "DELETE FROM messages", "CALL pragma_version()", "CHECKPOINT", "PIVOT memory ON rank USING count(*)",
            "WITH x AS (SELECT 1) DELETE FROM memory", "USE memory", "DETACH memory", "VACUUM",
            "SELECT * FROM read_csv('/etc/passwd')", "SELECT * FROM read_text('/etc/passwd')",
            "SELECT * FROM glob('/tmp/*')"]


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


def assert_intact(sql: object) -> None:
    for table in ("memory", "messages"):
        assert sql(f"SELECT count(*) >= 0 FROM {table}") == [(True,)]  # type: ignore[operator]


def test_monarch_sql_refuses_every_way_out(procs: ProcMesh, tmp_path: Path) -> None:
    procs.spawn("readonly_echo", Echo).ping.call(1).get(timeout=T)
    calls = procs.sql("SELECT count(*) FROM messages WHERE actor = 'readonly_echo'")
    for attack in attacks(tmp_path):
        with pytest.raises(QueryRefused, match="no access to files|read-only: refused") as e:
            monarch.sql(attack)
        assert isinstance(e.value, monarch.MonarchError)
        assert "allowed: SELECT" in str(e.value) or "no access" in str(e.value), attack
    assert list(tmp_path.iterdir()) == []
    assert procs.sql("SELECT count(*) FROM messages WHERE actor = 'readonly_echo'") == calls
    assert_intact(procs.sql)
    for read in READS:
        monarch.sql(read)


def test_the_refusal_names_what_and_what_is_allowed() -> None:
    with pytest.raises(QueryRefused) as e:
        monarch.sql("DROP TABLE memory")
    assert "refused DROP" in str(e.value) and "SELECT, WITH" in str(e.value) and "Nothing was run" in str(e.value)
    with pytest.raises(QueryRefused, match="EXPLAIN of something other than a read"):
        monarch.sql("EXPLAIN ANALYZE DROP TABLE memory")
    with pytest.raises(QueryRefused, match="no access to files.*/etc/passwd"):
        monarch.sql("SELECT * FROM read_csv('/etc/passwd')")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(READS + attacks(Path("/nonexistent"))), min_size=1, max_size=4))
def test_a_query_runs_only_when_every_statement_reads(statements: list[str]) -> None:
    store = Store(retain=1000)
    store.add(Events({"memory": [0, 1, 2, 3, 4, 5, 6]}), "m")
    query = "; ".join(statements)
    if all(s in READS for s in statements):
        store.sql(query)
    else:
        with pytest.raises(QueryRefused):
            store.sql(query)
    assert store.sql("SELECT count(*) FROM memory") == [(1,)]


def test_a_database_file_is_read_only_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_TELEMETRY_DB", str(tmp_path / "telemetry.db"))
    store = Store()
    store.add(Events({"memory": [0, 1, 2, 3, 4, 5, 6]}), "m")
    outside = tmp_path / "outside"
    outside.mkdir()
    for attack in attacks(outside):
        with pytest.raises(QueryRefused):
            store.sql(attack)
    assert list(outside.iterdir()) == []
    assert store.sql("SELECT mesh, rss_bytes FROM memory") == [("m", 1)]
    store._con.close()
    assert Store().sql("SELECT mesh, rss_bytes FROM memory") == [("m", 1)]  # the file holds the rows


def monarch_query(sql: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monarch", "query", "--pid", str(os.getpid()), sql],
                          capture_output=True, text=True, timeout=T, env={**os.environ, "COLUMNS": "200"})


def test_the_admin_endpoint_refuses_every_way_out(procs: ProcMesh, tmp_path: Path) -> None:
    for attack in attacks(tmp_path):
        answer = admin.query(attack, os.getpid(), timeout=T)
        assert answer["error"].startswith("QueryRefused: "), (attack, answer)
    out = monarch_query("SELECT * FROM read_csv('/etc/passwd')")
    assert out.returncode == 1 and "no access to files" in out.stderr and "root" not in out.stdout
    out = monarch_query(f"COPY memory TO '{tmp_path}/copied.csv'; DROP TABLE memory")
    assert out.returncode == 1 and "read-only: refused COPY" in out.stderr
    assert list(tmp_path.iterdir()) == []
    out = monarch_query("SELECT count(*) > 0 AS sampled FROM memory")
    assert out.returncode == 0 and "True" in out.stdout, out.stderr
    assert_intact(procs.sql)


def connect() -> socket.socket:
    info = next(c for c in admin.controllers() if c["pid"] == os.getpid())
    return socket.create_connection(("127.0.0.1", info["port"]), timeout=T)


def closed_after(sock: socket.socket, every: float) -> float:
    """Send one byte every `every` s (never the whole token) until the server hangs up; seconds it took."""
    start = time.monotonic()
    sock.settimeout(every)
    while time.monotonic() - start < T:
        try:
            sock.sendall(b"\0")
            if sock.recv(1) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return time.monotonic() - start


def test_a_slow_loris_is_dropped_and_holds_up_no_query(procs: ProcMesh) -> None:
    took: list[float] = []
    with connect() as loris:
        trickle = threading.Thread(target=lambda: took.append(closed_after(loris, 0.5)))
        trickle.start()
        time.sleep(0.2)
        start = time.monotonic()
        assert admin.query("SELECT 41 + 1 AS answer", os.getpid(), timeout=5)["rows"] == [[42]]
        assert time.monotonic() - start < 3.0
        out = monarch_query("SELECT 6 * 7 AS answer")
        assert out.returncode == 0 and "42" in out.stdout, out.stderr
        trickle.join(timeout=T)
    assert took and 0.8 <= took[0] <= admin.TOKEN_DEADLINE_S + 1.5, took


def test_many_idle_connections_hold_up_no_query(procs: ProcMesh) -> None:
    idle = [connect() for _ in range(16)]  # under MAX_CONNECTIONS
    try:
        time.sleep(0.2)
        start = time.monotonic()
        assert admin.query("SELECT 1 AS one", os.getpid(), timeout=5)["rows"] == [[1]]
        assert time.monotonic() - start < 3.0
    finally:
        for sock in idle:
            sock.close()
    assert len(idle) < admin.MAX_CONNECTIONS


def test_connections_beyond_the_limit_are_closed_at_once(procs: ProcMesh) -> None:
    socks = [connect() for _ in range(admin.MAX_CONNECTIONS + 4)]
    try:
        for sock in socks:
            sock.settimeout(admin.TOKEN_DEADLINE_S + 3)
        start = time.monotonic()
        extra = [sock.recv(1) for sock in socks[-4:]]  # the server closes these without reading
        assert extra == [b""] * 4 and time.monotonic() - start < admin.TOKEN_DEADLINE_S
        assert all(sock.recv(1) == b"" for sock in socks[:-4])  # the rest: once their token is overdue
        assert time.monotonic() - start < admin.TOKEN_DEADLINE_S + 2
    finally:
        for sock in socks:
            sock.close()
    assert admin.query("SELECT 1 AS one", os.getpid(), timeout=5)["rows"] == [[1]]
