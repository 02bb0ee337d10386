"""Telemetry on the controller: fetching the events its workers recorded, SQL over all of it, and the
periodic fetch while an OpenTelemetry export is on.

The Controller's `telemetry` (a `Collector`) answers `monarch.sql`, `ProcMesh.sql` and the admin endpoint
(runtime/debug/admin.py): it asks each job's workers for their events (ShipTelemetry, answered into a
TelemetrySink of conn.py), waits a while for them, then runs the query on the Store (telemetry/store.py).
Batches a worker sends on its own (Events) are stored by `on_events`, one of the controller's handlers.
"""
from __future__ import annotations

import logging

from monarch.runtime.control import codec
from monarch.runtime.control.commands import CONTROLLER, ShipTelemetry
from monarch.runtime.control.conn import Conn, Job, TelemetrySink
from monarch.runtime.control.futures import deadline_of
from monarch.runtime.control.handlers.requests import Jobs
from monarch.runtime.telemetry.events import RECORDER, Events
from monarch.runtime.telemetry.store import STORE, Limits, Rows

log = logging.getLogger("monarch.controller")
EXPORT_EVERY_S = 5.0  # how often events are fetched from the workers while an OpenTelemetry export is on


class Collector:
    """The telemetry of one controller's process and jobs: fetched on demand, queried with SQL."""

    def __init__(self, ctl: Jobs) -> None:
        self._ctl = ctl
        self._next_export = 0.0

    def tick(self, now: float) -> None:
        """With an OpenTelemetry exporter on, fetch every job's events now and then (without waiting); run
        by the controller's timers."""
        if STORE.exporter is None or now < self._next_export:
            return
        self._next_export = now + EXPORT_EVERY_S
        STORE.add(RECORDER.take(), "local")
        for mesh in list(self._ctl.meshes.values()):
            if mesh.live:
                self.ship(mesh)

    def ship(self, mesh: Job) -> TelemetrySink:
        """Ask the workers of `mesh` for the events they recorded; the batches are stored as they arrive.
        A rank that has not answered an earlier request yet (busy in a long call) is not asked again."""
        asked = mesh.awaiting_telemetry()
        sink = TelemetrySink(mesh.name, frozenset(r for r in mesh.shape.ranks() if r not in asked))
        if sink.missing:
            call_id = self._ctl.next_call_id()
            mesh.pending[(CONTROLLER, call_id)] = sink
            frame = codec.encode_frame([ShipTelemetry(call_id)])
            for r in sink.missing:
                self._ctl.send_rank(mesh, r, frame)
        return sink

    def sql(self, query: str, timeout: float, meshes: list[Job] | None = None, limits: Limits | None = None) -> Rows:
        """Run read-only SQL over the telemetry of this process and of `meshes` (default: every job),
        after fetching their workers' newest events for up to `timeout` s; `limits` end the query early."""
        late = self.collect(list(self._ctl.meshes.values()) if meshes is None else meshes, timeout)
        STORE.add(RECORDER.take(), "local")
        return STORE.sql(query, late, limits)

    def collect(self, meshes: list[Job], timeout: float) -> list[str]:
        """Fetch the events the workers of `meshes` recorded, waiting up to `timeout` s in all. Returns the
        ranks (`mesh[rank]`) that did not answer in time, such as a rank busy in a long call: their events
        are stored whenever they do answer."""
        asked = [(mesh, self.ship(mesh)) for mesh in meshes if mesh.live]
        self._ctl.wait_until(lambda: all(s.done for _, s in asked), deadline_of(timeout))
        late = [f"{mesh.name}[{r}]" for mesh, _ in asked for r in sorted(mesh.awaiting_telemetry())]
        if late:
            log.warning("monarch: %s did not send telemetry within %s s (busy in a long call?); the query runs "
                        "without their newest events", ", ".join(late), timeout)
        return late


def on_events(_ctl: Jobs, conn: Conn, msg: Events) -> None:
    """The controller's handler of a batch of events a worker sent."""
    assert conn.mesh is not None
    STORE.add(msg, conn.mesh.name)
