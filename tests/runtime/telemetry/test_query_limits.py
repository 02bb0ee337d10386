"""A long telemetry query is bounded and never freezes the controller.

It raises QueryTimeout (a MonarchError) after its time limit, through `procs.sql`, `monarch.sql` and the
admin endpoint; a client that hangs up cancels its query; and while one runs, the events the poller
receives are stored beside it, so actor calls keep their latency and the next query runs at once.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import monarch
from monarch.actor import Actor, ProcMesh, endpoint
from monarch.runtime.debug import admin
from monarch.runtime.telemetry import store
from monarch.runtime.telemetry.events import Events

T = 30.0
ENDLESS = "SELECT count(*) FROM range(1000000000000) a, range(10) b"  # hours of work, all read-only
SLACK = 5.0  # seconds a cancelled query may take to stop and report, on a loaded machine


class Chatty(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        print("ping", x, flush=True)  # a line of output: an event the controller's poller stores
        return x


def timed(fn: Callable[[], Any], limit: float = T) -> tuple[float, Any]:
    """Run `fn` on a thread of its own: the seconds it took and its result, or the exception it raised.
    Fails the test when it is still running after `limit` s."""
    out: list[tuple[float, Any]] = []

    def run() -> None:
        start = time.monotonic()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            value = e
        out.append((time.monotonic() - start, value))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert out, f"still running after {limit} s"
    return out[0]


def is_timeout(err: Any, seconds: str) -> bool:
    return (type(err).__name__ == "QueryTimeout" and isinstance(err, monarch.MonarchError)
            and f"more than {seconds} s" in str(err) and "MONARCH_QUERY_TIMEOUT" in str(err))


def test_a_long_query_times_out_through_procs_sql_and_monarch_sql(procs: ProcMesh,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_QUERY_TIMEOUT", "1")
    took, err = timed(lambda: procs.sql(ENDLESS))
    assert is_timeout(err, "1"), err
    assert isinstance(err, TimeoutError) and 1.0 <= took < 1.0 + SLACK, took
    took, err = timed(lambda: monarch.sql(ENDLESS, query_timeout=0.5))
    assert is_timeout(err, "0.5") and 0.5 <= took < 0.5 + SLACK, (took, err)
    took, rows = timed(lambda: procs.sql("SELECT 1 AS one"))
    assert rows == [(1,)]


def test_a_long_query_times_out_through_the_admin_endpoint(procs: ProcMesh) -> None:
    took, answer = timed(lambda: admin.query(ENDLESS, os.getpid(), timeout=1.0))
    assert isinstance(answer, dict) and answer["error"].startswith("QueryTimeout: "), answer
    assert "more than 1 s" in answer["error"] and "--timeout" in answer["error"]
    assert 1.0 <= took < 1.0 + admin.WAIT_S + SLACK, took
    out = subprocess.run([sys.executable, "-m", "monarch", "query", "--pid", str(os.getpid()), "--timeout", "0.5",
                          ENDLESS], capture_output=True, text=True, timeout=T)
    assert out.returncode == 1 and "QueryTimeout" in out.stderr and "more than 0.5 s" in out.stderr, out.stderr
    assert admin.query("SELECT 1 AS one", os.getpid(), timeout=5)["rows"] == [[1]]


def cpu_rate(window: float) -> float:
    """CPU seconds per second this process (all its threads, DuckDB's too) used over the next `window` s."""
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(window)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def test_a_client_that_hangs_up_cancels_its_query(procs: ProcMesh) -> None:
    info = next(c for c in admin.controllers() if c["pid"] == os.getpid())
    with socket.create_connection(("127.0.0.1", info["port"]), timeout=T) as sock:
        sock.sendall(bytes.fromhex(info["token"]))
        admin.send_json(sock, {"sql": ENDLESS, "timeout": 600})
        time.sleep(1.0)  # it fetched the workers' events and runs
        busy = cpu_rate(1.0)
    deadline = time.monotonic() + T
    while cpu_rate(0.5) > busy / 4:  # the query stopped: its threads went quiet
        assert time.monotonic() < deadline, f"the query still runs {T} s after its client hung up"
    took, answer = timed(lambda: admin.query("SELECT 1 AS one", os.getpid(), timeout=5))
    assert answer["rows"] == [[1]] and took < 5.0, (took, answer)


def test_an_actor_call_keeps_its_latency_while_a_long_query_runs(procs: ProcMesh,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "LOAD_AT", 1)  # every event is loaded into DuckDB at once, as when many wait
    chatty = procs.spawn("limits_chatty", Chatty)

    def latency() -> float:
        start = time.monotonic()
        chatty.ping.call(1).get(timeout=T)
        return time.monotonic() - start

    for _ in range(10):
        latency()
    alone = statistics.median(latency() for _ in range(15))
    monkeypatch.setenv("MONARCH_QUERY_TIMEOUT", "5")
    query = threading.Thread(target=lambda: pytest.raises(monarch.MonarchError, procs.sql, ENDLESS), daemon=True)
    query.start()
    time.sleep(1.0)
    took, during = timed(lambda: [latency() for _ in range(15)], limit=T)
    assert query.is_alive(), "the query ended before the calls were measured"
    assert isinstance(during, list), during
    assert statistics.median(during) < 25 * alone, (alone, during)
    query.join(T)
    assert not query.is_alive()


def test_store_loads_beside_a_running_query_and_cancels_it_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "LOAD_AT", 1)
    db = store.Store(retain=1000)
    gone = threading.Event()
    query = threading.Thread(target=lambda: pytest.raises(store.QueryCancelled, db.sql, ENDLESS,
                                                          limits=store.Limits(0, gone.is_set)), daemon=True)
    query.start()
    time.sleep(0.5)
    for i in range(20):  # as the poller stores what workers send: it never waits for the query
        timed(lambda: db.add(Events({"memory": [0, i, 2, 3, 4, 5, 6, 7]}), "m"), limit=T)
    assert query.is_alive()
    gone.set()
    query.join(T)
    assert not query.is_alive()
    assert db.sql("SELECT count(*), sum(rss_bytes) FROM memory", limits=store.Limits(T)) == [(20, sum(range(20)))]
