"""The controller: the process-wide control plane, the `Client` meshes send with on the controller.

One background thread polls every socket and pipe (epoll, poller.py): workers get in through the door
(door.py), jobs start and end through the lifecycle (launch.py), and the controller delivers replies to
CallStates, forwards actor-to-actor calls and fails every pending call of a mesh whose worker died or went
silent (heartbeat.py). A peer's messages dispatch by type through `HANDLERS`, the one table of every message
the controller handles (its handlers live in this module and in handlers/: requests.py, supervise.py,
breakpoints.py and collect.py, the telemetry Collector). User threads send directly.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Any

from monarch import config
from monarch.errors import MeshError, SupervisionError, TransportError
from monarch.runtime.control import codec, heartbeat, launch
from monarch.runtime.control.handlers import requests, supervise
from monarch.runtime.control.handlers.breakpoints import on_paused, on_resumed
from monarch.runtime.control.handlers.collect import Collector, on_events
from monarch.runtime.control.commands import (CONTROLLER, ActorFault, Busy, Call, DebugPaused, DebugResumed,
                                              Escalate, Forward, GetController, Heartbeat, Hello, MeshFailure,
                                              MeshRequest, PortSend, ProcExit, Reply, SpawnActors, SpawnProcs,
                                              StopProcs, describe_status)
from monarch.runtime.control.conn import Conn, ForwardSink, Job
from monarch.runtime.control.door import Door
from monarch.runtime.control.futures import CallState, Inbox
from monarch.runtime.control.poller import Poller
from monarch.runtime.telemetry.events import RECORDER, Events, now_us
from monarch.runtime.telemetry.logs import OUTPUT
from monarch.shape import Shape

log = logging.getLogger("monarch.controller")
ADMIN = "monarch.runtime.debug.admin"  # the admin endpoint, loaded only when MONARCH_ADMIN asks for it


class Controller:
    """The process-wide control plane; the `Client` that meshes send with on the controller."""
    threaded = True
    is_controller = True

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.meshes: dict[int, Job] = {}  # by mesh id, while the job runs
        self.ports: dict[int, Inbox] = {}  # channel receivers opened on the client (actors/ports.py)
        self.telemetry = Collector(self)
        self._watch = heartbeat.Watch()
        self._poller = Poller(self._expire)
        self.door = Door(self._poller, self.meshes, self)
        self.lifecycle = launch.Lifecycle(self._poller, self.door, self.meshes, self)  # spawn, stop
        self._poller.start()
        self.address = self.door.listen(config.host() or "127.0.0.1")
        if config.debug():
            logging.basicConfig()
            log.setLevel(logging.DEBUG)
        atexit.register(self.lifecycle.shutdown)
        if config.admin():
            from monarch.runtime.debug.admin import AdminServer  # the one lazy doorway up to runtime/debug
            self.admin = AdminServer(self.telemetry.sql)

    # -- client protocol -------------------------------------------------------------------------
    def next_call_id(self) -> int:
        return next(self._ids)

    def port_owner(self) -> None:
        return None

    def reach_host(self) -> str:
        bound = self.address.rpartition(":")[0]
        return config.advertise() or (bound if bound not in launch.WILDCARDS else "127.0.0.1")

    def open_port(self, port: int, inbox: Inbox) -> None:
        self.ports[port] = inbox

    def send_port(self, msg: PortSend) -> None:
        supervise.deliver_port(self, msg)  # routed as if a peer had sent it

    def ask(self, op: MeshRequest, state: CallState) -> None:
        """Run mesh request `op` for the client, now (requests.py); its answer settles `state`."""
        requests.run(self, op, None, partial(state.deliver, 0))

    def send(self, mesh_id: int, shape: Shape, call: Call, state: CallState | None) -> None:
        mesh = self.mesh(mesh_id)
        frame = codec.encode_frame([call])
        self.check_frame(mesh, frame, f"a call of {call.actor}.{call.endpoint} (with its pickled arguments)")
        if state is not None:
            mesh.pending[(CONTROLLER, call.call_id)] = state
        err = mesh.failure or mesh.unhandled.pop(call.actor, None)
        if err is not None or mesh.stopping:
            err = err or SupervisionError(f"mesh {mesh.name!r} is stopped; spawn a new one")
            if state is None:
                raise err
            state.fail_missing(err)
            return
        self.fan_out(mesh, shape, frame)

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        self._poller.drive(lambda: len(state.arrived) >= arrived, deadline, lambda: arrived - len(state.arrived))

    def wait_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        self._poller.drive(done, deadline)

    def mesh(self, mesh_id: int) -> Job:
        try:
            return self.meshes[mesh_id]
        except KeyError:
            if mesh_id in self.lifecycle.ended:
                raise self.lifecycle.ended[mesh_id] from None
            raise MeshError(f"proc mesh {mesh_id} does not exist in this controller (stopped, or from "
                            "another process)") from None

    def check_frame(self, mesh: Job, frame: bytes, what: str) -> None:
        """Raise TransportError, before anything is sent, when the workers of `mesh` would refuse `frame`."""
        if not codec.fits(frame, mesh.max_frame):
            raise codec.too_large(what, frame, mesh.max_frame)

    def fan_out(self, mesh: Job, shape: Shape, frame: bytes, what: str = "a message") -> None:
        """Send one encoded frame to every rank of `shape`; a failed send marks the rank lost."""
        self.check_frame(mesh, frame, what)
        for r in shape.ranks():
            self.send_rank(mesh, r, frame)

    def send_each(self, mesh_id: int, frames: dict[int, bytes], call_id: int, state: CallState | None,
                  what: str = "the tensor program") -> None:
        """Send each rank its own frame (`what`, for errors); `state` collects the replies to `call_id`."""
        mesh = self.mesh(mesh_id)
        if not mesh.live:
            err = mesh.failure or SupervisionError(f"mesh {mesh.name!r} is stopped; spawn a new one")
            if state is None:
                raise err
            state.fail_missing(err)
            return
        for r, frame in frames.items():
            self.check_frame(mesh, frame, f"{what} for rank {r}")
        if state is not None:
            mesh.pending[(CONTROLLER, call_id)] = state
        for r, frame in frames.items():
            self.send_rank(mesh, r, frame)

    def send_rank(self, mesh: Job, r: int, frame: bytes) -> None:
        mesh.frames += 1
        conn = mesh.conns[r]
        if conn is None:  # the rank never connected: lost like one whose send fails
            self._conn_lost(mesh, r)
            return
        try:
            conn.send(frame)
        except OSError:
            self._conn_lost(mesh, r)

    # -- timers and connections (run by whichever thread polls) ---------------------------------
    def _expire(self) -> float:
        """Fire due timers; seconds until the next one."""
        now = time.monotonic()
        nxt = self.door.expire(now)
        for mesh in list(self.meshes.values()):
            for rank, deadline in list(mesh.lost.items()):
                if now >= deadline:
                    self.fail(mesh, rank, mesh.pids[rank], "lost its control connection (exit status unknown)")
                else:
                    nxt = min(nxt, deadline - now)
        self.telemetry.tick(now)
        return min(nxt, self._watch.tick(now, self.meshes, self.fail), OUTPUT.tick(now))

    # -- messages from authenticated peers (door.py) -----------------------------------------------
    def handle(self, conn: Conn, msg: Any) -> None:
        handler = HANDLERS.get(type(msg))
        if handler is None:
            assert conn.header is not None
            log.warning("monarch controller: dropped unexpected %s from rank %d", type(msg).__name__, conn.header.rank)
            return
        handler(self, conn, msg)

    def peer_closed(self, conn: Conn) -> None:
        self.door.close(conn)
        mesh, header = conn.mesh, conn.header
        if mesh is not None and header is not None and header.role == codec.ROLE_WORKER:
            self._conn_lost(mesh, header.rank)

    def _conn_lost(self, mesh: Job, rank: int) -> None:
        if mesh.live and rank not in mesh.lost:
            mesh.lost[rank] = time.monotonic() + config.death_grace()

    def fail(self, mesh: Job, rank: int, pid: int, status: str) -> None:
        """Fail every pending and later call on `mesh`, tell supervisors, tear the job down."""
        mesh.lost.clear()
        if not mesh.live:
            return
        failure = MeshFailure(mesh.name, rank, mesh.coords(rank) if rank >= 0 else "", pid, status, mesh.host_of(rank))
        mesh.failure = SupervisionError(failure.message() + "; spawn a new proc mesh to continue (the "
                                        "failures and logs tables of monarch.sql() hold what led to it)",
                                        rank=rank, coords=failure.coords, status=status)
        now = now_us()
        RECORDER.add("failures", (rank, mesh.name, "supervision", failure.who, status, now))
        RECORDER.add("procs", (rank, mesh.name, pid, "", "died", status, now))
        mesh.settled.set()
        mesh.fail_pending(mesh.failure)
        log.warning("monarch: %s", failure.message())
        if mesh.proc is not None:
            launch.kill_group(mesh.proc, mesh.kill_signal)
        supervise.route(self, failure, mesh.owner)  # to the mesh's owner


# -- messages from authenticated peers, by type ---------------------------------------------------
def _reply(_ctl: Controller, conn: Conn, msg: Reply) -> None:
    assert conn.mesh is not None
    conn.mesh.deliver(msg)


def _hello(_ctl: Controller, conn: Conn, msg: Hello) -> None:
    mesh, header = conn.mesh, conn.header
    assert mesh is not None and header is not None
    mesh.pids[header.rank], mesh.monitors[header.rank], mesh.gpus[header.rank] = msg.pid, msg.monitor, msg.gpus
    mesh.hosts[header.rank] = msg.host
    RECORDER.add("procs", (header.rank, mesh.name, msg.pid, msg.host, "started", "", now_us()))
    if mesh.heartbeat > 0:
        with suppress(OSError):  # the peer is gone: its reader sees the EOF
            conn.send(codec.encode_frame([Heartbeat(heartbeat.interval(mesh.heartbeat))]))
    if all(c is not None for c in mesh.conns) and all(mesh.pids):
        mesh.settled.set()


def _busy(_ctl: Controller, conn: Conn, msg: Busy) -> None:
    conn.excused_until = time.monotonic() + msg.seconds


def _proc_exit(ctl: Controller, conn: Conn, msg: ProcExit) -> None:
    mesh = conn.mesh
    assert mesh is not None
    mesh.stderr_tail.extend(msg.stderr_tail.splitlines())
    ctl.fail(mesh, msg.rank, msg.pid, describe_status(msg.wait_status, msg.stderr_tail))


def _forward(ctl: Controller, source: Conn, msg: Forward) -> None:
    """An actor's call of another actor mesh: sent on to its workers, their replies back to `source`."""
    assert source.mesh is not None and source.header is not None
    call = replace(msg.call, reply_to=source.addr, sender=f"{source.mesh.name}[{source.header.rank}]")
    target = ctl.meshes.get(msg.mesh_id)
    sink = ForwardSink(source, call, msg.shape)
    if target is None or not target.live:
        if call.want_reply:
            sink.fail_missing(target.failure if target and target.failure else
                              SupervisionError(f"mesh {msg.mesh_id} is stopped"))
        return
    frame = codec.encode_frame([call])
    try:
        ctl.check_frame(target, frame, f"a call of {call.actor}.{call.endpoint} from {call.sender}")
    except TransportError as e:
        if call.want_reply:
            sink.fail_missing(e)
        else:
            log.warning("monarch controller: dropped a broadcast: %s", e)
        return
    if call.want_reply:
        target.pending[(source.addr, call.call_id)] = sink
    ctl.fan_out(target, msg.shape, frame)


HANDLERS: dict[type, Callable[[Controller, Conn, Any], None]] = {  # every message a peer may send, by type
    Reply: _reply, Forward: _forward, Hello: _hello, Busy: _busy, ProcExit: _proc_exit, Events: on_events,
    SpawnProcs: requests.serve, SpawnActors: requests.serve, StopProcs: requests.serve,
    GetController: requests.serve, DebugPaused: on_paused, DebugResumed: on_resumed,
    ActorFault: supervise.on_fault, Escalate: supervise.on_escalate, PortSend: supervise.on_port}

_controller: Controller | None = None
_controller_lock = threading.Lock()


def controller() -> Controller:
    """The process's controller, started on first use."""
    global _controller
    with _controller_lock:
        if _controller is None:
            _controller = Controller()
        return _controller
