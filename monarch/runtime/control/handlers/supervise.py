"""Supervision and port routing on the client: the controller's side of them (its handler table, controller.py,
names `on_fault`, `on_escalate` and `on_port`; a failed job is routed from Controller.fail).

A supervision event (an actor that failed and stopped, a worker process that died) goes to the owner of
what failed: the actor that spawned it gets `__supervise__(failure)` on its rank (a truthy result handles
it; otherwise its worker escalates it to that actor's owner), and what the client spawned ends at the
root, where `monarch.actor.unhandled_fault_hook(failure)` runs, looked up when it runs so that a client
can replace it. Each owner hears of each failed rank once.

Monarch's default hook ends the client (status 1). Here the fault is delivered where the program can see
it: calls waiting on the failed rank (every rank, when a process died) raise SupervisionError, and once
monarch raised that error to the program, the fault was delivered (caught, the client goes on; uncaught,
the program ends with it). Otherwise the main thread is interrupted at a safe point: a knock signal whose
handler acts only where no frame of monarch is on the main thread's stack (else it knocks again), prints
the report once and raises SystemExit, or, inside an IPython cell, KeyboardInterrupt (the cell stops, the
kernel lives; with no cell running, the report is printed and nothing is interrupted).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from types import FrameType

from monarch.errors import SupervisionError
from monarch.runtime.control import codec
from monarch.runtime.control.commands import ActorFault, Escalate, MeshFailure, Owner, PortSend, Reply, Supervise
from monarch.runtime.control.conn import Conn, Job
from monarch.runtime.control.handlers.requests import Jobs
from monarch.runtime.telemetry.events import RECORDER, now_us

log = logging.getLogger("monarch")
_told: set[tuple[str, str, int, Owner | None]] = set()
KNOCK = signal.SIGRTMIN + 5  # what the main thread gets while an unhandled fault waits for a safe point
KNOCK_EVERY_S = 0.02
_MONARCH = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep  # monarch's own frames


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """What the client does with a supervision event nobody handled (replace it as
    `monarch.actor.unhandled_fault_hook = f`): the default ends the client with status 1 (raising
    SystemExit(1) here; the module doc says where). A replacement that returns drops the event; one that
    raises ends the client the same way (with its SystemExit code, else 1)."""
    raise SystemExit(1)


@dataclass
class Fault:
    """An unhandled fault of one actor mesh (or proc mesh, when a process died), until it is delivered
    (its error was raised to the program) or it ended the client."""
    failure: MeshFailure
    code: int
    error: SupervisionError
    mesh: Job | None  # the controller's record of the failed proc mesh, if it still has one
    settled: threading.Event = field(default_factory=threading.Event)

    def delivered(self) -> bool:
        """Whether monarch raised the fault's error to the program (a call of it raised SupervisionError)."""
        return self.error.__traceback__ is not None

    def settle_delivered(self) -> None:
        """Delivered: the next call of the failed actor mesh no longer raises it (it is stopped, as usual)."""
        if self.mesh is not None:
            self.mesh.unhandled.pop(self.failure.actor, None)
        self.settled.set()


_faults: dict[tuple[str, str], Fault] = {}  # (proc mesh name, actor mesh name or "") -> its fault
_lock = threading.Lock()


def route(ctl: Jobs, failure: MeshFailure, owner: Owner | None) -> None:
    """Give `failure` to `owner` (an actor), or to the root's hook when the client owns what failed."""
    key = (failure.mesh, failure.actor, failure.rank, owner)
    if key in _told:
        return
    _told.add(key)
    target = ctl.meshes.get(owner.mesh_id) if owner is not None else None
    if owner is None or target is None or not target.live:
        threading.Thread(target=_run_hook, args=(ctl, failure), name="monarch-unhandled-fault", daemon=True).start()
        return
    ctl.send_each(target.id, {owner.rank: codec.encode_frame([Supervise(failure, owner.actor)])}, 0, None,
                  "a supervision event")


def _run_hook(ctl: Jobs, failure: MeshFailure) -> None:
    hook = getattr(sys.modules.get("monarch.actor"), "unhandled_fault_hook", unhandled_fault_hook)
    try:
        hook(failure)
    except SystemExit as e:
        _unhandled(ctl, failure, e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - a hook that fails leaves the fault unhandled
        log.error("monarch: unhandled_fault_hook raised %r on %s; ending the client", e, failure.message())
        _unhandled(ctl, failure, 1)
    else:
        log.warning("monarch: unhandled supervision event dropped by unhandled_fault_hook: %s", failure.message())


def _unhandled(ctl: Jobs, failure: MeshFailure, code: int) -> None:
    """Fail the calls waiting on the failed rank with the fault's SupervisionError (and the next call of a
    failed actor mesh), then knock until the fault is delivered or ends the client. Later ranks of an actor
    mesh share its fault."""
    mesh = next((m for m in list(ctl.meshes.values()) if m.name == failure.mesh), None)
    with _lock:
        fault = _faults.get((failure.mesh, failure.actor))
        new = fault is None
        if fault is None:
            fault = _faults[(failure.mesh, failure.actor)] = Fault(failure, code, _error(failure, mesh), mesh)
            if mesh is not None and failure.actor:
                mesh.unhandled[failure.actor] = fault.error  # the next call of that actor mesh raises it
    if mesh is not None and failure.actor:
        for state in list(mesh.pending.values()):
            if getattr(state, "actor", None) == (mesh.id, failure.actor) and failure.rank in state.missing():
                state.deliver(failure.rank, False, fault.error)
    if new:
        _knock(fault)


def _error(failure: MeshFailure, mesh: Job | None) -> SupervisionError:
    """What the program gets for `failure`: the mesh's own error when its process died, else the report."""
    if mesh is not None and mesh.failure is not None and not failure.actor:
        return mesh.failure
    return SupervisionError(failure.report(), rank=failure.rank, coords=failure.coords, status=failure.status)


def _knock(fault: Fault) -> None:
    """Signal the main thread until `fault` is settled; with an idle IPython shell, report it at once."""
    main = threading.main_thread()
    if signal.getsignal(KNOCK) is not _on_knock:  # monarch was first imported off the main thread
        _report([fault], "KeyboardInterrupt is delivered to the main thread")
        signal.pthread_kill(main.ident or 0, signal.SIGINT)
        return
    while not fault.settled.is_set() and main.is_alive():
        if fault.delivered():
            fault.settle_delivered()
        elif _shell() and not _in_cell(sys._current_frames().get(main.ident or 0)):
            _report([fault], "No cell was running, so none was interrupted")
        else:
            signal.pthread_kill(main.ident or 0, KNOCK)
            fault.settled.wait(KNOCK_EVERY_S)


def _on_knock(signum: int, frame: FrameType | None) -> None:
    """In the main thread: end the client for the unsettled faults, if this is a safe point."""
    faults = [f for f in list(_faults.values()) if not f.settled.is_set() and not f.delivered()]
    if not faults or _inside_monarch(frame):
        return
    if not _shell():
        _report(faults, f"The program exits with status {faults[0].code}")
        raise SystemExit(faults[0].code)
    if _in_cell(frame):
        _report(faults, "The cell was interrupted; the kernel keeps running")
        raise KeyboardInterrupt


def _report(faults: list[Fault], outcome: str) -> None:
    """Write the report of each fault on stderr, once: they are settled."""
    for fault in faults:
        fault.settled.set()
        sys.stderr.write(f"Unhandled monarch error on the root actor, hostname={socket.gethostname()}, "
                         f"PID={os.getpid()} at time {datetime.now()}: {fault.failure.report()}\n")
    sys.stderr.write(f"{outcome}.\n")
    sys.stderr.flush()


def _frames(frame: FrameType | None) -> list[FrameType]:
    found = []
    while frame is not None:
        found.append(frame)
        frame = frame.f_back
    return found


def _inside_monarch(frame: FrameType | None) -> bool:
    return any(f.f_code.co_filename.startswith(_MONARCH) for f in _frames(frame))


def _shell() -> bool:
    """Whether this process is an IPython shell (a Jupyter kernel, or IPython's terminal)."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def _in_cell(frame: FrameType | None) -> bool:
    """Whether the main thread (at `frame`) runs a cell: IPython's run_code is on its stack."""
    return any(f.f_code.co_name == "run_code" and "IPython" in f.f_code.co_filename for f in _frames(frame))


if threading.current_thread() is threading.main_thread():
    signal.signal(KNOCK, _on_knock)


# -- the controller's handlers ---------------------------------------------------------------------
def on_fault(ctl: Jobs, conn: Conn, msg: ActorFault) -> None:
    """An actor stopped on the rank of `conn`: its owner hears of it."""
    mesh, header = conn.mesh, conn.header
    assert mesh is not None and header is not None
    rank = header.rank
    failure = MeshFailure(mesh.name, rank, mesh.coords(rank), mesh.pids[rank], msg.status, mesh.host_of(rank),
                          msg.actor, msg.detail)
    RECORDER.add("failures", (rank, mesh.name, "actor", f"{msg.actor} on rank {rank}", msg.status, now_us()))
    route(ctl, failure, mesh.actors.get(msg.actor))


def on_escalate(ctl: Jobs, conn: Conn, msg: Escalate) -> None:
    """Actor `msg.actor` did not handle the failure: its own owner hears of it."""
    assert conn.mesh is not None
    route(ctl, msg.failure, conn.mesh.actors.get(msg.actor))


def on_port(ctl: Jobs, conn: Conn, msg: PortSend) -> None:
    deliver_port(ctl, msg)


def deliver_port(ctl: Jobs, msg: PortSend) -> None:
    """A port's message (from a worker, or sent here): into the caller's pending call (a reply port), a
    receiver here, or the worker holding the receiver."""
    ref = msg.ref
    if ref.reply is not None:
        mesh_id, reply_to, call_id, rank = ref.reply
        mesh = ctl.meshes.get(mesh_id)
        if mesh is not None:
            mesh.deliver(Reply(call_id, reply_to, rank, msg.ok, msg.value))
    elif ref.owner is None:
        inbox = ctl.ports.get(ref.port)
        if inbox is not None:
            inbox.put(msg.ok, msg.value, ref.rank)
    else:
        mesh = ctl.meshes.get(ref.owner[0])
        if mesh is not None and mesh.live:
            ctl.send_each(mesh.id, {ref.owner[1]: codec.encode_frame([msg])}, 0, None, "a port's message")
