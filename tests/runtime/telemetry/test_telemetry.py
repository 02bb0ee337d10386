"""Telemetry: events recorded on every process, shipped in batches, queried with SQL (DuckDB)."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import monarch
from monarch import Shard
from monarch.actor import Actor, ProcMesh, endpoint, this_host
from monarch.errors import SupervisionError
from monarch.runtime.control.conn import TelemetrySink
from monarch.runtime.telemetry.events import TABLES, now_us

T = 30.0


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x

    @endpoint
    def shout(self) -> None:
        print("telemetry says hi", flush=True)

    @endpoint
    def fail(self) -> None:
        raise ValueError("no")

    @endpoint
    def refuse(self) -> None:
        raise ValueError("the answer is not 42: " + "x" * 1000)

    @endpoint
    def relay(self, other: Any) -> int:
        return int(other.ping.call_one(7).get(timeout=T))

    @endpoint
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    def warn(self) -> None:
        logging.getLogger("telemetry.test").warning("careful: %d", 3)

    @endpoint
    def configure_and_log(self) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(message)s")
        logging.getLogger("telemetry.test").info("configured: %d", 1)


def test_calls_become_rows_of_messages(procs: ProcMesh) -> None:
    echo = procs.spawn("telemetry_echo", Echo)
    one = echo.slice(dp=0, tp=1)
    for i in range(1000):
        one.ping.call_one(i).get(timeout=T)
    rows = procs.sql("SELECT rank, endpoint, count(*), min(end_us - start_us) >= 0, min(start_us - enqueue_us) >= 0, "
                     "max(status) FROM messages WHERE actor = 'telemetry_echo' GROUP BY rank, endpoint")
    assert rows == [(1, "ping", 1000, True, True, "ok")]
    assert rows.columns[:2] == ["rank", "endpoint"]
    assert procs.sql("SELECT count(*) FROM actors WHERE actor = 'telemetry_echo'") == [(4,)]


def test_messages_name_their_sender(procs: ProcMesh) -> None:
    echo = procs.spawn("telemetry_relay", Echo)
    assert echo.slice(dp=1, tp=0).relay.call_one(echo.slice(dp=0, tp=1)).get(timeout=T) == 7
    assert procs.sql("SELECT rank, endpoint, sender FROM messages WHERE actor = 'telemetry_relay' ORDER BY rank") == [
        (1, "ping", f"{procs.name}[2]"), (2, "relay", "controller")]


def test_a_busy_rank_holds_up_no_query_and_loses_no_events(procs: ProcMesh) -> None:
    one = procs.spawn("telemetry_nap", Echo).slice(dp=0, tp=1)
    for i in range(10):
        one.ping.call_one(i).get(timeout=T)
    napping = one.nap.call_one(3.0)
    time.sleep(0.3)
    started = time.monotonic()
    for _ in range(3):  # the busy rank is asked once, not once per query
        assert procs.sql("SELECT 1", timeout=0.2).late == [f"{procs.name}[1]"]
    assert time.monotonic() - started < 2.0
    assert sum(type(s) is TelemetrySink for s in procs._mesh.pending.values()) == 1
    napping.get(timeout=T)
    rows = procs.sql("SELECT endpoint, count(*) FROM messages WHERE actor = 'telemetry_nap' GROUP BY 1 ORDER BY 1")
    assert rows == [("nap", 1), ("ping", 10)] and rows.late == []


def test_logging_records_keep_their_level_and_still_print(procs: ProcMesh) -> None:
    procs.spawn("telemetry_warn", Echo).slice(dp=0, tp=1).warn.call_one().get(timeout=T)
    query = "SELECT rank, stream, level, text FROM logs WHERE text LIKE '%careful: 3' ORDER BY stream"
    deadline = time.monotonic() + T
    while len(rows := procs.sql(query)) < 2 and time.monotonic() < deadline:  # stderr comes through the monitor
        time.sleep(0.05)
    assert rows == [(1, "logging", "WARNING", "telemetry.test: careful: 3"), (1, "stderr", "", "careful: 3")]


def test_logging_configured_by_the_user_works_as_without_monarch(procs: ProcMesh) -> None:
    procs.spawn("telemetry_configure", Echo).slice(dp=1, tp=0).configure_and_log.call_one().get(timeout=T)
    query = "SELECT rank, stream, level, text FROM logs WHERE text LIKE '%configured: 1' ORDER BY stream"
    deadline = time.monotonic() + T
    while len(rows := procs.sql(query)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows == [(2, "logging", "INFO", "telemetry.test: configured: 1"), (2, "stderr", "", "INFO|configured: 1")]


def test_errors_logs_and_standard_sql(procs: ProcMesh) -> None:
    echo = procs.spawn("telemetry_sql", Echo)
    echo.shout.call().get(timeout=T)
    with pytest.raises(monarch.ActorError):
        echo.slice(dp=1, tp=1).fail.call_one().get(timeout=T)
    for i in range(20):
        echo.ping.call(i).get(timeout=T)
    assert procs.sql("SELECT rank FROM logs WHERE text = 'telemetry says hi' ORDER BY rank") == [(0,), (1,), (2,), (3,)]
    assert ("remote error", "telemetry_sql.fail") in procs.sql("SELECT kind, what FROM failures WHERE rank = 3")
    # a join, a window function and a percentile: the slowest call per rank
    rows = procs.sql("""
        SELECT rank, endpoint, took FROM (
            SELECT m.rank, m.endpoint, m.end_us - m.start_us AS took,
                   row_number() OVER (PARTITION BY m.rank ORDER BY m.end_us - m.start_us DESC) AS k
            FROM messages m JOIN actors a ON a.rank = m.rank AND a.actor = m.actor
            WHERE m.actor = 'telemetry_sql') WHERE k = 1 ORDER BY rank""")
    assert [r[0] for r in rows] == [0, 1, 2, 3] and all(r[2] >= 0 for r in rows)
    p50 = procs.sql("SELECT quantile_cont(end_us - start_us, 0.5) FROM messages WHERE actor = 'telemetry_sql'")
    assert p50[0][0] >= 0


def test_tensor_programs_collectives_and_memory(procs: ProcMesh) -> None:
    x = monarch.distribute_tensor(torch.randn(8, 8), procs, {"dp": Shard(0)})
    monarch.synchronize(procs, timeout=T)
    since = now_us()
    x.sum().item()
    rows = procs.sql(f"SELECT count(*), min(bytes) FROM collectives WHERE kind = 'all_reduce' AND start_us >= {since}")
    assert rows == [(4, 4)]  # one all_reduce of a float32 scalar, seen by each of the 4 ranks
    assert procs.sql("SELECT count(DISTINCT rank) FROM ops WHERE op = 'eager flush'") == [(4,)]
    assert procs.sql("SELECT count(DISTINCT rank), min(rss_bytes) > 0 FROM memory") == [(4, True)]


def test_kill_9_is_one_failures_row_with_the_signal() -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}, name="telemetry_victim") as victim:
        pid = victim.pids[1]
        echo = victim.spawn("e", Echo)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SupervisionError, match="failures"):
            echo.ping.call(1).get(timeout=T)
    rows = monarch.sql("SELECT rank, kind, detail FROM failures WHERE mesh = 'telemetry_victim'")
    assert rows == [(1, "supervision", "killed by signal 9 (SIGKILL)")]
    assert ("died",) in monarch.sql(f"SELECT event FROM procs WHERE mesh = 'telemetry_victim' AND pid = {pid}")


def test_every_table_exists_with_rank() -> None:
    for table, cols in TABLES.items():
        assert cols[0] == ("rank", "INTEGER"), table
        assert monarch.sql(f"SELECT * FROM {table} LIMIT 0").columns == [c for c, _ in cols]


def test_a_separate_store_loads_batches() -> None:
    from monarch.runtime.telemetry.events import Events
    from monarch.runtime.telemetry.store import Store
    store = Store()
    flat = [v for i in range(20_000) for v in (i % 4, "a", "ping", "controller", 100, i, i + 1, i + 2, "ok")]
    store.add(Events({"messages": flat[:5000 * 9]}), "one")
    store.add(Events({"messages": flat[5000 * 9:]}), "two")
    assert store.sql("SELECT count(*), count(DISTINCT rank), sum(end_us - start_us) FROM messages") == [
        (20_000, 4, 20_000)]
    by_mesh = store.sql("SELECT mesh, count(*) FROM messages GROUP BY mesh ORDER BY mesh")
    assert by_mesh == [("one", 5000), ("two", 15_000)]


def test_debug_prints_the_events_before_a_failure(procs: ProcMesh, capsys: pytest.CaptureFixture[str]) -> None:
    echo = procs.spawn("telemetry_debug", Echo)
    one = echo.slice(dp=1, tp=0)
    for i in range(3):
        one.ping.call_one(i).get(timeout=T)
    with pytest.raises(monarch.ActorError):
        one.fail.call_one().get(timeout=T)
    rows = monarch.debug(5)
    out = capsys.readouterr().out
    assert "last 5 events of rank 2 up to its failure" in out
    kinds = [r[1] for r in rows]
    assert kinds[:2] == ["failure", "message"] and "telemetry_debug.fail error" in rows[1][2]
    assert "telemetry_debug.ping ok" in out


def test_events_become_opentelemetry_spans(procs: ProcMesh) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from monarch.runtime.telemetry.store import STORE
    spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    STORE.export_to(provider, MeterProvider(metric_readers=[metrics]))
    try:
        echo = procs.spawn("telemetry_otel", Echo)
        for i in range(5):
            echo.slice(dp=0, tp=0).ping.call_one(i).get(timeout=T)
        with pytest.raises(monarch.ActorError):
            echo.slice(dp=0, tp=0).fail.call_one().get(timeout=T)
        deadline = time.monotonic() + 20  # the controller fetches events every few seconds while exporting
        while time.monotonic() < deadline and not any(s.name == "telemetry_otel.fail" for s in
                                                      spans.get_finished_spans()):
            time.sleep(0.2)
    finally:
        STORE.exporter = None
    done = spans.get_finished_spans()
    pings = [s for s in done if s.name == "telemetry_otel.ping"]
    assert len(pings) == 5 and all(s.attributes["rank"] == 0 and s.end_time >= s.start_time for s in pings)
    assert any(s.name == "failure: remote error" for s in done)
    data = metrics.get_metrics_data()
    found = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    calls = [p for p in found["monarch.messages"].data.data_points
             if p.attributes["endpoint"] == "telemetry_otel.ping"]
    assert sum(p.value for p in calls) == 5
    assert {"monarch.message.duration", "monarch.worker.rss"} <= set(found)


def test_profiling_times_every_instruction() -> None:
    with this_host().spawn_procs(per_host={"x": 2}, name="telemetry_profiled", env={"MONARCH_PROFILE": "1"}) as p:
        x = monarch.distribute_tensor(torch.ones(4, 4), p, {"x": Shard(0)})
        assert (x * 2 + 1).sum().item() == 48
        rows = p.sql("SELECT DISTINCT rank, op FROM ops WHERE program = -1 AND op LIKE 'aten::%'")
    assert {(r, op) for r in (0, 1) for op in ("aten::mul.Tensor", "aten::add.Tensor")} <= set(rows)


def test_a_busy_worker_samples_its_memory_every_second(procs: ProcMesh) -> None:
    one = procs.spawn("telemetry_busy", Echo).slice(dp=1, tp=1)
    one.ping.call_one(0).get(timeout=T)  # the worker has imported this module
    since = now_us()
    while now_us() - since < 2_200_000:  # a few hundred calls: far fewer events than a shipped batch holds
        one.ping.call_one(0).get(timeout=T)
        time.sleep(0.005)
    samples = procs.sql(f"SELECT time_us FROM memory WHERE rank = 3 AND time_us >= {since} ORDER BY time_us")
    assert len(samples) >= 3  # about one a second while busy, and one with the shipped batch


def test_worker_rows_name_their_mesh(procs: ProcMesh) -> None:
    echo = procs.spawn("telemetry_mesh", Echo)
    echo.ping.call(1).get(timeout=T)
    assert procs.sql("SELECT DISTINCT mesh FROM messages WHERE actor = 'telemetry_mesh'") == [(procs.name,)]
    assert (procs.name,) in procs.sql("SELECT DISTINCT mesh FROM memory")
    if not torch.cuda.is_available():  # the workers never touched CUDA
        assert procs.sql("SELECT max(cuda_allocated_bytes), max(cuda_reserved_bytes), max(cuda_peak_bytes) "
                         "FROM memory") == [(0, 0, 0)]


def test_rows_convert_to_arrow_and_pandas_when_installed() -> None:
    rows = monarch.sql("SELECT 1 AS a, 'x' AS b UNION ALL SELECT 2, 'y' ORDER BY a")
    assert rows == [(1, "x"), (2, "y")] and rows.columns == ["a", "b"]
    pa = pytest.importorskip("pyarrow")
    table = rows.arrow()
    assert isinstance(table, pa.Table) and table.column("b").to_pylist() == ["x", "y"]


def test_recording_creates_no_objects_for_the_garbage_collector() -> None:
    """Always-on recording must not make the collector run (a full pass over torch's heap takes ~0.1 s)."""
    import gc

    from monarch.runtime.telemetry.events import Recorder
    recorder = Recorder()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for i in range(10_000):
            recorder.add("messages", (0, "echo", "ping", "controller", 8, i, i + 1, i + 2, "ok"))
        grew = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert grew < 10
    last = list(recorder.take().table("messages"))[-1]
    assert last == (0, "echo", "ping", "controller", 8, 9999, 10_000, 10_001, "ok")


def test_the_readme_documents_every_column() -> None:
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    documented = {m[1]: re.sub(r"\s*\([^)]*\)", "", m[2]).split(", ")
                  for m in re.finditer(r"^\| `(\w+)` \| (.+) \|$", readme, re.M)}
    assert documented == {table: [c for c, _ in cols] for table, cols in TABLES.items()}


def test_each_table_keeps_the_newest_rows_within_the_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    from processes import run_script
    monkeypatch.setenv("MONARCH_TELEMETRY_RETAIN", "1000")  # the child controller's
    child = run_script("""
        import json, time
        from monarch.actor import Actor, endpoint, this_host
        from monarch.runtime.telemetry.events import TABLES, now_us

        class Talker(Actor):
            @endpoint
            def say(self, i: int) -> int:
                print(f"line {i}", flush=True)
                return i

        with this_host().spawn_procs(per_host={"x": 1}, name="retained") as procs:
            one = procs.spawn("talker", Talker).slice(x=0)
            for i in range(1500):
                one.say.call_one(i).get(timeout=30)
            procs.sql("SELECT 1")  # loaded: from here on the database holds at most 1000 rows per table
            for i in range(1500, 3000):
                if i == 2000:
                    since = now_us()
                one.say.call_one(i).get(timeout=30)
            deadline = time.monotonic() + 30  # output reaches the controller through the monitor
            while not procs.sql("SELECT count(*) FROM logs WHERE text = 'line 2999'")[0][0]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            counts = {t: procs.sql(f"SELECT count(*) FROM {t}")[0][0] for t in TABLES}
            calls = procs.sql(f"SELECT count(*), min(start_us) >= {since} FROM messages")[0]
            lines = procs.sql("SELECT min(CAST(substr(text, 6) AS INTEGER)), max(CAST(substr(text, 6) AS INTEGER)) "
                              "FROM logs WHERE text LIKE 'line %'")[0]
            print("RESULT", json.dumps({"counts": counts, "calls": calls, "lines": lines}), flush=True)
    """)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out[-2000:]
    result = json.loads(out.rsplit("RESULT ", 1)[1])
    assert all(n <= 1000 for n in result["counts"].values()), result
    assert result["calls"] == [1000, True]  # the newest 1000 calls: every one started after call 2000 did
    assert result["lines"] == [2000, 2999]


def test_a_remote_error_leaves_its_message_in_failures_and_top(procs: ProcMesh) -> None:
    from monarch.runtime.telemetry import events as telemetry
    with pytest.raises(monarch.ActorError):
        procs.spawn("telemetry_refuse", Echo).slice(dp=1, tp=0).refuse.call_one().get(timeout=T)
    [(detail,)] = procs.sql("SELECT detail FROM failures WHERE what = 'telemetry_refuse.refuse'")
    assert detail.startswith("ValueError: the answer is not 42: xxx") and detail.endswith("...")
    assert len(detail) == telemetry.DETAIL_CHARS and "Remote traceback" not in detail
    out = subprocess.run([sys.executable, "-m", "monarch", "top", "--once", "--pid", str(os.getpid())],
                         capture_output=True, text=True, timeout=T, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "ValueError: the answer is not 42" in out.stdout, out.stderr


def test_a_failed_kernel_leaves_its_message_in_failures(procs: ProcMesh) -> None:
    x = monarch.distribute_tensor(torch.randn(4, 3), procs, {"dp": Shard(0)})
    bad = monarch.distribute_tensor(torch.tensor([0, 99]), procs)
    since = now_us()
    with pytest.raises(monarch.RemoteError):
        (torch.index_select(x, 1, bad) * 2).sum().item()
    details = [d for (d,) in procs.sql(f"SELECT detail FROM failures WHERE time_us >= {since}")]
    assert details and all("index_select" in d and "out of" in d for d in details), details
