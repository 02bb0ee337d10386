"""Mesh requests on the controller: start a proc mesh, spawn actors, stop a proc mesh, for whoever asks.

ProcMesh and HostMesh make them with proc_mesh.ask: on the controller they run at once; an actor asks
from its worker (Worker.ask), and the controller runs the request for it and answers with a Reply. Starting
or stopping a job blocks, so those run on a thread of their own; spawning actors runs in order with the
asking actor's later calls. Each proc mesh and actor mesh records its `Owner` (the asking actor's mesh id,
name and rank) on the controller's Mesh record: `Mesh.owner`, `Mesh.actors[name]`. Launchers other than
this host's are kept here under a key, so that a pickled HostMesh names its own.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from monarch.errors import MeshError, SupervisionError
from monarch.runtime.control import codec, launch
from monarch.runtime.control.commands import Owner, ProcsInfo, Reply, SpawnActors, SpawnProcs, StopProcs
from monarch.runtime.control.conn import Conn, Mesh
from monarch.runtime.telemetry.events import RECORDER, now_us

LOCAL = 0  # the launcher key of this host (`this_host()`, in any process)
_launchers: dict[int, launch.Launcher] = {}
_keys = itertools.count(LOCAL + 1)
_unnamed = itertools.count()  # proc meshes spawned without a name: procs, procs_1, procs_2, ...
Answer = Callable[[bool, Any], None]


def keep_launcher(launcher: launch.Launcher) -> int:
    """The key under which `launcher` is kept (in the controller's process) for SpawnProcs to name."""
    if type(launcher) is launch.LocalLauncher:
        return LOCAL
    key = next(_keys)
    _launchers[key] = launcher
    return key


def launcher_of(key: int) -> launch.Launcher:
    if key == LOCAL:
        return launch.LocalLauncher()
    try:
        return _launchers[key]
    except KeyError:
        raise MeshError(f"no host mesh with launcher key {key} in this controller (a HostMesh pickled by "
                        "another controller process?); pass the actor a HostMesh of this controller") from None


def info_of(mesh: Mesh) -> ProcsInfo:
    return ProcsInfo(mesh.id, mesh.name, mesh.shape, tuple(mesh.hosts), tuple(mesh.pids))


def serve(ctl: Any, source: Conn, op: Any) -> None:
    """Run a request from an actor on a worker of `source`; that actor owns what it makes."""
    assert source.mesh is not None and source.header is not None
    owner = Owner(source.mesh.id, op.actor, source.header.rank)

    def answer(ok: bool, value: Any) -> None:
        frame = codec.encode_frame([Reply(op.call_id, source.addr, 0, ok, codec.dumps(value))])
        with suppress(OSError):  # the asking worker is gone; its own supervision reports that
            source.send(frame)

    if type(op) is SpawnActors:
        run(ctl, op, owner, answer)  # here, in order with the calls the actor sends next
    else:
        threading.Thread(target=run, args=(ctl, op, owner, answer), name="monarch-request", daemon=True).start()


def run(ctl: Any, op: Any, owner: Owner | None, answer: Answer) -> None:
    """Run `op` for `owner` (None: the client); `answer(ok, value or exception)`."""
    try:
        value = RUN[type(op)](ctl, op, owner)
    except Exception as e:  # noqa: BLE001 - the asker's get() raises it
        answer(False, e)
        return
    answer(True, value)


def _spawn_procs(ctl: Any, op: SpawnProcs, owner: Owner | None) -> ProcsInfo:
    n = next(_unnamed) if not op.name else 0
    name = op.name or ("procs" if n == 0 else f"procs_{n}")
    mesh = ctl.spawn(name, op.shape, launcher_of(op.launcher), dict(op.env) if op.env is not None else None,
                     op.host)
    mesh.owner = owner
    return info_of(mesh)


def _spawn_actors(ctl: Any, op: SpawnActors, owner: Owner | None) -> None:
    mesh: Mesh = ctl.mesh(op.mesh_id)  # a stopped or failed mesh raises why
    name = op.spawn.name
    if name in mesh.actors:
        raise MeshError(f"proc mesh {mesh.name!r} already has actors named {name!r}; pick another name")
    if not mesh.live:
        raise mesh.failure or SupervisionError(f"proc mesh {mesh.name!r} is stopped; spawn a new one")
    ctl.fan_out(mesh, op.spawn.shape, codec.encode_frame([op.spawn]),
                f"spawning {name!r} (the pickled class and constructor arguments)")
    mesh.actors[name] = owner
    now = now_us()
    for r in op.spawn.shape.ranks():
        RECORDER.add("actors", (r, mesh.name, name, op.cls_name, now))


def _stop_procs(ctl: Any, op: StopProcs, owner: Owner | None) -> None:
    mesh = ctl.meshes.get(op.mesh_id)
    if mesh is not None:  # else stopped already: stopping is idempotent
        stop_tree(ctl, mesh)


def stop_tree(ctl: Any, mesh: Mesh) -> None:
    """Stop the proc meshes that actors of `mesh` spawned (theirs first), then `mesh`."""
    for child in [m for m in list(ctl.meshes.values()) if m.owner is not None and m.owner.mesh_id == mesh.id]:
        stop_tree(ctl, child)
    ctl.stop(mesh)


RUN: dict[type, Callable[[Any, Any, Owner | None], Any]] = {
    SpawnProcs: _spawn_procs, SpawnActors: _spawn_actors, StopProcs: _stop_procs}
HANDLERS: dict[type, Callable[[Any, Conn, Any], None]] = {kind: serve for kind in RUN}  # the controller's
