"""Supervision and port routing on the client (the controller's side of them), registered into its handlers.

A supervision event (an actor that failed and stopped, a worker process that died) goes to the owner of
what failed: the actor that spawned it gets `__supervise__(failure)` on its rank (a truthy result handles
it; otherwise its worker escalates it to that actor's owner), and what the client spawned ends at the
root, where `monarch.actor.unhandled_fault_hook(failure)` runs, looked up when it runs so that a client
can replace it. Monarch's default writes the report and exits the client with status 1: this one
delivers KeyboardInterrupt to the main thread (the interpreter can only finish there) and exits with
the hook's SystemExit code. Each owner hears of each failed rank once.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
from datetime import datetime
from typing import Any

from monarch.runtime.control import codec
from monarch.runtime.control import controller as ctl_module
from monarch.runtime.control.commands import ActorFault, Escalate, MeshFailure, Owner, PortSend, Reply, Supervise
from monarch.runtime.telemetry.events import RECORDER, now_us

log = logging.getLogger("monarch")
_told: set[tuple[str, str, int, Owner | None]] = set()
_exit_code: list[int] = []


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """What the client does with a supervision event nobody handled (replace it as
    `monarch.actor.unhandled_fault_hook = f`): the default writes the report and exits with status 1. A
    replacement that returns drops the event; one that raises exits (with its SystemExit code, else 1)."""
    sys.stderr.write(f"Unhandled monarch error on the root actor, hostname={socket.gethostname()}, PID={os.getpid()} "
                     f"at time {datetime.now()}: {failure.report()}\n"
                     "Delivering KeyboardInterrupt to main thread to exit the program\n")
    sys.stderr.flush()
    sys.exit(1)


def route(ctl: Any, failure: MeshFailure, owner: Owner | None) -> None:
    """Give `failure` to `owner` (an actor), or to the root's hook when the client owns what failed."""
    key = (failure.mesh, failure.actor, failure.rank, owner)
    if key in _told:
        return
    _told.add(key)
    target = ctl.meshes.get(owner.mesh_id) if owner is not None else None
    if owner is None or target is None or not target.live:
        threading.Thread(target=_run_hook, args=(failure,), name="monarch-unhandled-fault", daemon=True).start()
        return
    ctl.send_each(target.id, {owner.rank: codec.encode_frame([Supervise(failure, owner.actor)])}, 0, None,
                  "a supervision event")


def _run_hook(failure: MeshFailure) -> None:
    hook = getattr(sys.modules.get("monarch.actor"), "unhandled_fault_hook", unhandled_fault_hook)
    try:
        hook(failure)
    except SystemExit as e:
        _exit_client(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - a hook that fails leaves the fault unhandled
        log.error("monarch: unhandled_fault_hook raised %r on %s; exiting with status 1", e, failure.message())
        _exit_client(1)
    else:
        log.warning("monarch: unhandled supervision event dropped by unhandled_fault_hook: %s", failure.message())


def _exit_client(code: int) -> None:
    _exit_code[:] = [code]
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


@atexit.register
def _exit_status() -> None:
    """Registered before the client's other exit handlers, so it runs after them: the status of the exit."""
    if _exit_code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code[0])


# -- the controller's handlers ---------------------------------------------------------------------
def _fault(ctl: Any, conn: Any, msg: ActorFault) -> None:
    mesh, rank = conn.mesh, conn.header.rank
    failure = MeshFailure(mesh.name, rank, mesh.coords(rank), mesh.pids[rank], msg.status, mesh.host_of(rank),
                          msg.actor, msg.detail)
    RECORDER.add("failures", (rank, mesh.name, "actor", f"{msg.actor} on rank {rank}", msg.status, now_us()))
    route(ctl, failure, mesh.actors.get(msg.actor))


def _escalate(ctl: Any, conn: Any, msg: Escalate) -> None:
    """Actor `msg.actor` did not handle the failure: its own owner hears of it."""
    route(ctl, msg.failure, conn.mesh.actors.get(msg.actor))


def _port(ctl: Any, conn: Any, msg: PortSend) -> None:
    """A port's message: into the caller's pending call (a reply port), a receiver here, or the worker
    holding the receiver."""
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


ctl_module.HANDLERS.update({ActorFault: _fault, Escalate: _escalate, PortSend: _port})
ctl_module.SUPERVISE[:] = [route]
