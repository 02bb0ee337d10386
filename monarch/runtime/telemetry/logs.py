"""Worker output on the controller's console: streamed per line, folded over ranks, or kept off it.

The controller hands each mesh's stdout and stderr here (its job's pipes, every line labelled
`[dp=1,tp=0] ` by the rank monitors). Per mesh, as `ProcMesh.logging_option` sets it, a `LogSink` writes
them through, or collects them for `aggregate_window_sec` seconds and then prints each distinct line once
with the ranks that printed it and a count (`[dp=0..3] x4 loss 0.5`), or drops them (telemetry, fed
separately, still records them). Windows end on time (`OUTPUT.tick`), at the mesh's stop and at exit.
"""
from __future__ import annotations

import atexit
import itertools
import math
import sys
import threading
import time
from dataclasses import dataclass, field

STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class LogMode:
    """Where a mesh's output goes: to this console or not; folded over windows of `window` s or line by line."""
    stream_to_client: bool = True
    window: float | None = None


@dataclass
class Fold:
    """One distinct line of a window: the mesh points that printed it (first seen first) and how often."""
    dims: tuple[str, ...]
    points: dict[tuple[int, ...], None] = field(default_factory=dict)
    count: int = 0

    def render(self, text: str) -> str:
        label = fold_label(self.dims, list(self.points))
        return f"[{label}] {'' if self.count == 1 else f'x{self.count} '}{text}\n"


class LogSink:
    """The output of one mesh: complete lines go to the console as its mode says; a line's unfinished end
    waits for the rest of it."""

    def __init__(self, mode: LogMode) -> None:
        self.mode = mode
        self.ended: set[str] = set()  # streams whose pipe reached its end
        self._partial = dict.fromkeys(STREAMS, "")
        self._window: dict[tuple[str, str], Fold] = {}  # (stream, text) -> its fold, in order of first line
        self._due: float | None = None  # when the open window ends

    @property
    def due(self) -> float | None:
        return self._due

    def write(self, stream: str, text: str, now: float) -> None:
        if not self.mode.stream_to_client:
            self._partial[stream] = ""
            return
        if self.mode.window is None:
            text, self._partial[stream] = self._partial[stream] + text, ""
            _emit(stream, text)
            return
        *lines, self._partial[stream] = (self._partial[stream] + text).split("\n")
        self._collect(stream, lines, now)

    def end(self, stream: str, now: float) -> None:
        """The pipe of `stream` is at its end: its unfinished last line counts as a line."""
        self.ended.add(stream)
        rest, self._partial[stream] = self._partial[stream], ""
        if rest:
            self.write(stream, rest + "\n", now)

    def flush(self) -> None:
        """Print the open window: each distinct line once, stdout's lines, then stderr's."""
        window, self._window, self._due = self._window, {}, None
        for stream in STREAMS:
            lines = [fold.render(text) for (s, text), fold in window.items() if s == stream]
            if lines:
                _emit(stream, "".join(lines))

    def _collect(self, stream: str, lines: list[str], now: float) -> None:
        direct = []
        for line in lines:
            parsed = parse_label(line)
            if parsed is None:  # not a rank's line (the launcher's own messages): printed as it comes
                direct.append(line + "\n")
                continue
            dims, point, text = parsed
            fold = self._window.setdefault((stream, text), Fold(dims))
            fold.points[point] = None
            fold.count += 1
            if self._due is None:
                assert self.mode.window is not None, self.mode
                self._due = now + self.mode.window
        if direct:
            _emit(stream, "".join(direct))


class Output:
    """Every mesh's sink, by mesh id. The controller writes into it from whichever thread polls, and its
    poller calls `tick` to end windows on time; users set modes from their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[int, LogSink] = {}
        self._drained: set[int] = set()  # meshes whose pipes both reached their end
        self._next = math.inf  # no window ends before this (read without the lock: the poller's fast path)

    def _sink(self, mesh_id: int) -> LogSink:
        sink = self._sinks.get(mesh_id)
        if sink is None:
            sink = self._sinks[mesh_id] = LogSink(LogMode())
        return sink

    def set_mode(self, mesh_id: int, mode: LogMode) -> None:
        """From now on, `mesh_id`'s output goes as `mode` says; the open window is printed first."""
        with self._lock:
            sink = self._sink(mesh_id)
            sink.flush()
            sink.mode = mode

    def write(self, mesh_id: int, stream: str, text: str) -> None:
        with self._lock:
            sink = self._sink(mesh_id)
            sink.write(stream, text, time.monotonic())
            if sink.due is not None:
                self._next = min(self._next, sink.due)

    def end(self, mesh_id: int, stream: str) -> None:
        """The pipe of `stream` reached its end; once both have, the sink prints what it holds and goes."""
        with self._lock:
            sink = self._sink(mesh_id)
            sink.end(stream, time.monotonic())
            if sink.ended.issuperset(STREAMS):
                sink.flush()
                del self._sinks[mesh_id]
                self._drained.add(mesh_id)

    def drained(self, mesh_id: int) -> bool:
        """Both pipes of `mesh_id` reached their end: all its output is printed."""
        with self._lock:
            return mesh_id in self._drained

    def flush(self, mesh_id: int) -> None:
        """Print `mesh_id`'s open window now (at the mesh's stop)."""
        with self._lock:
            if mesh_id in self._sinks:
                self._sinks[mesh_id].flush()

    def tick(self, now: float) -> float:
        """Print every window that is due; seconds until the next one is."""
        if now < self._next:
            return self._next - now
        with self._lock:
            for sink in self._sinks.values():
                if sink.due is not None and sink.due <= now:
                    sink.flush()
            self._next = min((s.due for s in self._sinks.values() if s.due is not None), default=math.inf)
            return self._next - now

    def flush_all(self) -> None:
        """At exit: every open window and unfinished line."""
        with self._lock:
            for sink in self._sinks.values():
                for stream in STREAMS:
                    sink.end(stream, time.monotonic())
                sink.flush()


def parse_label(line: str) -> tuple[tuple[str, ...], tuple[int, ...], str] | None:
    """`[dp=1,tp=0] text` -> (dims, coords, text); None for a line without a rank's label."""
    if not line.startswith("["):
        return None
    label, sep, text = line[1:].partition("] ")
    if not sep:
        return None
    try:
        pairs = [kv.split("=") for kv in label.split(",")] if label else []
        return tuple(k for k, _ in pairs), tuple(int(v) for _, v in pairs), text
    except ValueError:  # not `k=v,...` with integer values
        return None


def fold_label(dims: tuple[str, ...], points: list[tuple[int, ...]]) -> str:
    """The points as boxes of per-dim ranges: `dp=0..3`, `dp=0..1,tp=0..1`, `dp={0,2},tp=1`, and, where they
    form no box, several separated by spaces (`dp=0,tp=0 dp=1,tp=1`)."""
    return " ".join(_boxes(dims, sorted(set(points))))


def _boxes(dims: tuple[str, ...], points: list[tuple[int, ...]]) -> list[str]:
    if not dims:
        return [""]
    heads: dict[tuple[str, ...], list[int]] = {}  # the boxes of the other dims -> the first dim's values
    for head, group in itertools.groupby(points, key=lambda p: p[0]):
        heads.setdefault(tuple(_boxes(dims[1:], [p[1:] for p in group])), []).append(head)
    return [f"{dims[0]}={_values(vals)}" + (f",{rest}" if rest else "") for rests, vals in heads.items()
            for rest in rests]


def _values(values: list[int]) -> str:
    """Sorted integers as runs: `2`, `0..3`, `{0..1,3}`."""
    runs = [[v for _, v in run] for _, run in itertools.groupby(enumerate(values), key=lambda iv: iv[1] - iv[0])]
    text = ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)
    return text if len(runs) == 1 else "{" + text + "}"


def _emit(stream: str, text: str) -> None:
    out = getattr(sys, stream)  # as it is now (a test's capture, a notebook's stream)
    out.write(text)
    out.flush()


OUTPUT = Output()
atexit.register(OUTPUT.flush_all)  # registered before any controller: runs after it stopped the meshes
