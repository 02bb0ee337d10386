"""Telemetry SQL is read-only, and the admin endpoint serves its clients concurrently.

Every statement that would read a file, write one, change a setting, load an extension or change a
table is refused with QueryRefused, through `monarch.sql` and through the admin endpoint (`admin.query`
and a real `monarch query`), and the tables work afterwards. Slow or idle unauthenticated connections
are dropped after TOKEN_DEADLINE_S and never hold up a real query: they wait in one event loop, capped per
peer, and only authenticated connections take one of the MAX_CONNECTIONS serving slots.
"""
from __future__ import annotations

import os
import select
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
from monarch.runtime.debug import admin
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
    store.add(Events({"memory": [0, 1, 2, 3, 4, 5, 6, 7]}), "m")
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
    store.add(Events({"memory": [0, 1, 2, 3, 4, 5, 6, 7]}), "m")
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


def announced() -> dict:
    return next(c for c in admin.controllers() if c["pid"] == os.getpid())


def connect(source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", announced()["port"]), timeout=T, source_address=(source, 0))


def is_closed(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server hung up on `sock` (within `wait` s); it never sends a silent client anything."""
    ready, _, _ = select.select([sock], [], [], wait)
    return bool(ready) and sock.recv(1) == b""


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


HOLDER = """
import select, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks, end = [], time.monotonic() + 120
while time.monotonic() < end:  # n silent connections, each reopened as soon as the server drops it
    ready = set(select.select(socks, [], [], 0)[0])
    for s in ready:
        s.close()
    first = not socks
    socks = [s for s in socks if s not in ready]
    while len(socks) < n:
        socks.append(socket.create_connection(("127.0.0.1", port)))
    if first:
        print("holding", flush=True)
    time.sleep(0.01)
"""


def test_silent_connections_held_open_starve_no_query(procs: ProcMesh) -> None:
    """Another process keeps 40 unauthenticated connections open all the time; every real query gets in."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(announced()["port"]), "40"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        for i in range(20):
            start = time.monotonic()
            assert admin.query(f"SELECT {i} AS i", os.getpid(), timeout=5)["rows"] == [[i]]
            assert time.monotonic() - start < 5.0
            time.sleep(0.1)  # spread over a few token deadlines, while the holder reconnects
        assert holder.poll() is None  # it held its connections all along
    finally:
        holder.kill()
        holder.wait(timeout=T)


def test_a_peer_past_its_cap_loses_its_own_oldest_waiting_connection(procs: ProcMesh,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections from 127.0.0.2 play another user's: they never push out this user's waiting ones."""
    from monarch.runtime.control.controller import controller
    from monarch.runtime.debug.gate import Caps, Token, user_of
    door = controller().admin.gate
    monkeypatch.setattr(door, "handshake", Token(door.handshake.token, T))  # nothing expires during the test
    monkeypatch.setattr(door, "caps", Caps(per_peer=8))
    monkeypatch.setattr(door, "peer_of", lambda c: "other" if c.getpeername()[0] == "127.0.0.2" else user_of(c))
    ours = [connect() for _ in range(7)]
    theirs = [connect("127.0.0.2") for _ in range(20)]
    try:
        assert all(is_closed(sock, T) for sock in theirs[:12])  # at once, not after a deadline
        time.sleep(0.2)
        assert not any(is_closed(sock) for sock in ours + theirs[12:])
        assert admin.query("SELECT 1 AS one", os.getpid(), timeout=5)["rows"] == [[1]]
        ours.append(connect())  # this user's eighth waiting connection: at its cap, nothing goes yet
        time.sleep(0.2)
        assert not any(is_closed(sock) for sock in ours)
        assert admin.query("SELECT 2 AS two", os.getpid(), timeout=5)["rows"] == [[2]]  # past it: ours[0] goes
        assert is_closed(ours[0], T) and not any(is_closed(sock) for sock in ours[1:] + theirs[12:])
    finally:
        for sock in ours + theirs:
            sock.close()


def test_the_peer_is_the_user_owning_the_other_end() -> None:
    from monarch.runtime.debug.gate import user_of
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname(), timeout=T) as client:
            conn, _ = server.accept()
            with conn:
                assert user_of(conn) == f"uid {os.geteuid()}"
                assert user_of(client) == f"uid {os.geteuid()}"  # either end


def test_authenticated_connections_past_the_limit_are_told_busy(procs: ProcMesh) -> None:
    held = [connect() for _ in range(admin.MAX_CONNECTIONS)]
    try:
        for sock in held:
            sock.sendall(bytes.fromhex(announced()["token"]))  # then no request: each holds a serving slot
        deadline = time.monotonic() + T
        answer = admin.query("SELECT 1 AS one", os.getpid(), timeout=5)
        while "busy" not in answer.get("error", "") and time.monotonic() < deadline:
            time.sleep(0.05)
            answer = admin.query("SELECT 1 AS one", os.getpid(), timeout=5)
        assert answer["error"].startswith("busy: the controller serves 32 queries"), answer
    finally:
        for sock in held:
            sock.close()
    answer = admin.query("SELECT 1 AS one", os.getpid(), timeout=5)
    while "busy" in answer.get("error", "") and time.monotonic() < deadline:
        time.sleep(0.05)
        answer = admin.query("SELECT 1 AS one", os.getpid(), timeout=5)
    assert answer["rows"] == [[1]]
