"""ProcMesh.logging_option: worker output folded over ranks, streamed per line, kept off the console, and
the ranks' logging level; on a real 4-rank mesh, read from the client's stdout and stderr (capfd)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from monarch.actor import Actor, ProcMesh, current_rank, endpoint, this_host
from monarch.errors import MeshError
from monarch.runtime.telemetry.logs import LogMode, LogSink, fold_label

T = 30.0


class Printer(Actor):
    @endpoint
    def say(self, text: str, times: int = 1) -> None:
        for _ in range(times):
            print(text, flush=True)

    @endpoint
    def say_rank(self, text: str) -> None:
        print(f"{text} {current_rank()['dp']}", flush=True)

    @endpoint
    def log(self, level: int, text: str) -> None:
        logging.getLogger("train").log(level, text)

    @endpoint
    def mark(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def procs() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"dp": 4}) as p:
        yield p


@pytest.fixture(scope="module")
def printer(procs: ProcMesh) -> Actor:
    return procs.spawn("printer", Printer)


def read_until(capfd: pytest.CaptureFixture[str], done: Callable[[str, str], bool], timeout: float = 10.0
               ) -> tuple[str, str]:
    """What the client printed (stdout, stderr) from now until `done(out, err)` or `timeout` s."""
    out = err = ""
    deadline = time.monotonic() + timeout
    while not done(out, err) and time.monotonic() < deadline:
        time.sleep(0.02)
        o, e = capfd.readouterr()
        out, err = out + o, err + e
    return out, err


def test_identical_lines_of_every_rank_fold_into_one(procs: ProcMesh, printer: Actor,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    procs.logging_option(stream_to_client=True, aggregate_window_sec=0.5).get(timeout=T)
    start = time.monotonic()
    printer.say.call("loss 0.5").get(timeout=T)
    out, _ = read_until(capfd, lambda o, e: "loss 0.5" in o)
    assert "[dp=0..3] x4 loss 0.5\n" in out
    assert out.count("loss 0.5") == 1, out
    assert time.monotonic() - start >= 0.5  # printed when the window ended, not line by line


def test_distinct_lines_stay_separate_and_repeats_count(procs: ProcMesh, printer: Actor,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    procs.logging_option(aggregate_window_sec=0.5).get(timeout=T)
    printer.say_rank.call("my rank is").get(timeout=T)
    printer.slice(dp=1).say.call_one("twice on one rank", times=2).get(timeout=T)
    printer.slice(dp=slice(2, 4)).say.call("on two ranks").get(timeout=T)
    out, _ = read_until(capfd, lambda o, e: "on two ranks" in o and o.count("my rank is") == 4)
    for r in range(4):
        assert f"[dp={r}] my rank is {r}\n" in out
    assert "[dp=1] x2 twice on one rank\n" in out
    assert "[dp=2..3] x2 on two ranks\n" in out
    assert "x4" not in out


def test_window_none_streams_every_line_with_its_rank(procs: ProcMesh, printer: Actor,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    procs.logging_option(stream_to_client=True, aggregate_window_sec=None).get(timeout=T)
    printer.say.call("each line").get(timeout=T)
    out, _ = read_until(capfd, lambda o, e: o.count("each line") == 4)
    assert sorted(line for line in out.splitlines() if "each line" in line) == [
        f"[dp={r}] each line" for r in range(4)]


def test_stream_to_client_false_keeps_output_off_the_console_but_in_telemetry(
        procs: ProcMesh, printer: Actor, capfd: pytest.CaptureFixture[str]) -> None:
    procs.logging_option(stream_to_client=False, aggregate_window_sec=None).get(timeout=T)
    printer.say.call("hidden line").get(timeout=T)
    printer.mark.call("hidden mark").get(timeout=T)
    deadline = time.monotonic() + 10
    query = "SELECT count(*) FROM logs WHERE mesh = '%s' AND text IN ('hidden line', 'hidden mark')" % procs.name
    while procs.sql(query, timeout=T)[0][0] < 8 and time.monotonic() < deadline:  # the controller read them all
        time.sleep(0.05)
    assert procs.sql(query, timeout=T)[0][0] == 8
    out, err = capfd.readouterr()
    assert "hidden" not in out + err
    procs.logging_option(aggregate_window_sec=None).get(timeout=T)
    printer.say.call("shown again").get(timeout=T)
    out, _ = read_until(capfd, lambda o, e: o.count("shown again") == 4)
    assert out.count("shown again") == 4 and "hidden" not in out


def test_level_filters_logging_records(procs: ProcMesh, printer: Actor, capfd: pytest.CaptureFixture[str]) -> None:
    procs.logging_option(aggregate_window_sec=None, level=logging.INFO).get(timeout=T)
    printer.log.call(logging.DEBUG, "debug record").get(timeout=T)
    printer.log.call(logging.INFO, "info record").get(timeout=T)
    printer.mark.call("info done").get(timeout=T)  # each rank's stderr stays in order: earlier lines came first
    _, err = read_until(capfd, lambda o, e: e.count("info done") == 4)
    assert err.count("info record") == 4 and "debug record" not in err
    procs.logging_option(aggregate_window_sec=None, level=logging.ERROR).get(timeout=T)
    printer.log.call(logging.WARNING, "warning record").get(timeout=T)
    printer.log.call(logging.ERROR, "error record").get(timeout=T)
    printer.mark.call("error done").get(timeout=T)
    _, err = read_until(capfd, lambda o, e: e.count("error done") == 4)
    assert err.count("error record") == 4 and "warning record" not in err
    procs.logging_option(aggregate_window_sec=0.5, level=logging.ERROR).get(timeout=T)
    printer.log.call(logging.ERROR, "folded record").get(timeout=T)
    _, err = read_until(capfd, lambda o, e: "folded record" in e)
    assert "[dp=0..3] x4 folded record\n" in err


def test_logging_option_is_awaitable(procs: ProcMesh) -> None:
    async def main() -> None:
        assert await procs.logging_option(aggregate_window_sec=None) is None

    asyncio.run(main())


def test_bad_options_fail_before_anything_changes(procs: ProcMesh) -> None:
    with pytest.raises(MeshError, match="without streaming to the client"):
        procs.logging_option(stream_to_client=False, aggregate_window_sec=3)
    with pytest.raises(MeshError, match="invalid logging level 300"):
        procs.logging_option(level=300)
    with pytest.raises(MeshError, match="positive number of seconds"):
        procs.logging_option(aggregate_window_sec=0)


def test_stop_prints_the_open_window(capfd: pytest.CaptureFixture[str]) -> None:
    mesh = this_host().spawn_procs(per_host={"dp": 2})
    try:
        mesh.logging_option(aggregate_window_sec=600).get(timeout=T)
        mesh.spawn("printer", Printer).say.call("last words").get(timeout=T)
    finally:
        mesh.stop()
    out, _ = capfd.readouterr()
    assert "[dp=0..1] x2 last words\n" in out


EXIT_SCRIPT = textwrap.dedent("""
    from monarch.actor import Actor, endpoint, this_host

    class Printer(Actor):
        @endpoint
        def say(self, text: str) -> None:
            print(text, flush=True)

    procs = this_host().spawn_procs(per_host={"dp": 2})
    procs.logging_option(aggregate_window_sec=600).get(timeout=30)
    procs.spawn("printer", Printer).say.call("words at exit").get(timeout=30)
    print("script done", flush=True)
""")


def test_exit_prints_the_open_window_of_a_mesh_never_stopped() -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("[dp=0..1] x2 words at exit\n"), done.stdout


def test_fold_label_names_boxes_of_points() -> None:
    assert fold_label(("dp",), [(3,), (0,), (1,), (2,)]) == "dp=0..3"
    assert fold_label(("dp",), [(2,)]) == "dp=2"
    assert fold_label(("dp", "tp"), [(0, 0), (0, 1), (1, 0), (1, 1)]) == "dp=0..1,tp=0..1"
    assert fold_label(("dp", "tp"), [(0, 1), (2, 1)]) == "dp={0,2},tp=1"
    assert fold_label(("dp", "tp"), [(0, 0), (1, 1)]) == "dp=0,tp=0 dp=1,tp=1"
    assert fold_label(("dp", "tp"), [(0, 0), (0, 1), (1, 0)]) == "dp=0,tp=0..1 dp=1,tp=0"
    assert fold_label(("hosts", "gpus"), [(h, g) for h in range(2) for g in (0, 1, 2, 5)]) == \
        "hosts=0..1,gpus={0..2,5}"


def test_sink_joins_lines_split_across_reads(capsys: pytest.CaptureFixture[str]) -> None:
    sink = LogSink(LogMode(stream_to_client=True, window=1.0))
    sink.write("stdout", "[dp=0] hel", 0.0)
    sink.write("stdout", "lo\n[dp=1] hello\n[dp=1] bye\nlaunch", 0.1)
    sink.write("stdout", "er says hi\n[dp=0] end", 0.2)
    assert sink.due == pytest.approx(1.1)  # the window opens with its first whole line
    assert capsys.readouterr().out == "launcher says hi\n"  # no rank's label: at once
    sink.flush()
    assert capsys.readouterr().out == "[dp=0..1] x2 hello\n[dp=1] bye\n"
    sink.end("stdout", 0.3)
    sink.flush()
    assert capsys.readouterr().out == "[dp=0] end\n"
