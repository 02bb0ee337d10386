"""Mesh requests on the controller: start a proc mesh, spawn actors, stop a proc mesh, get a singleton.

ProcMesh and HostMesh (runtime/actors) make them with `Client.ask`: the Controller runs them at once; an
actor asks from its worker (Worker.ask), and the controller runs the request for it (`serve`, in its
handler table, controller.py) and answers with a Reply. Starting or stopping a job blocks, so those run on
a thread of their own; spawning actors runs in order with the asking actor's later calls. Each proc mesh
and actor mesh records its `Owner` (the asking actor's mesh id, name and rank) on the controller's Job
record: `Job.owner`, `Job.actors[name]`. Launchers other than this host's are kept here under a key, so
that a pickled HostMesh names its own. A singleton actor (GetController) runs alone on a one-process mesh
of this host, spawned once per name; the client owns it.
"""
from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Protocol

from monarch import config
from monarch.errors import MeshError, SpawnError, SupervisionError
from monarch.runtime.control import codec, launch
from monarch.runtime.control.bootstrap import mesh_device
from monarch.runtime.control.commands import (GetController, MeshRequest, Owner, ProcsInfo, Reply, SpawnActor,
                                              SpawnActors, SpawnProcs, StopProcs)
from monarch.runtime.control.conn import Conn, Job
from monarch.runtime.control.futures import CallState, Inbox
from monarch.runtime.telemetry.events import RECORDER, now_us
from monarch.shape import Shape

LOCAL = 0  # the launcher key of this host (`this_host()`, in any process)
_launchers: dict[int, launch.Launcher] = {}
_keys = itertools.count(LOCAL + 1)
_unnamed = itertools.count()  # proc meshes spawned without a name: procs, procs_1, procs_2, ...
_singletons: dict[str, int] = {}  # singleton actor mesh name -> the id of the proc mesh it runs on
_singletons_lock = threading.Lock()
Answer = Callable[[bool, Any], None]


class Jobs(Protocol):
    """The Controller as its handlers use it: its jobs, how to start, reach and stop them (`lifecycle`), and
    the channel receivers open on the client."""
    meshes: dict[int, Job]
    ports: dict[int, Inbox]
    lifecycle: launch.Lifecycle

    def mesh(self, mesh_id: int) -> Job: ...

    def fan_out(self, mesh: Job, shape: Shape, frame: bytes, what: str = "a message") -> None: ...

    def send_each(self, mesh_id: int, frames: dict[int, bytes], call_id: int, state: CallState | None,
                  what: str = "the tensor program") -> None: ...

    def send_rank(self, mesh: Job, r: int, frame: bytes) -> None: ...

    def next_call_id(self) -> int: ...

    def wait_until(self, done: Callable[[], bool], deadline: float | None) -> None: ...


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


def info_of(mesh: Job) -> ProcsInfo:
    return ProcsInfo(mesh.id, mesh.name, mesh.shape, tuple(mesh.hosts), tuple(mesh.pids), mesh.device)


def serve(ctl: Jobs, source: Conn, op: MeshRequest) -> None:
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


def run(ctl: Jobs, op: MeshRequest, owner: Owner | None, answer: Answer) -> None:
    """Run `op` for `owner` (None: the client); `answer(ok, value or exception)`."""
    try:
        value = RUN[type(op)](ctl, op, owner)
    except Exception as e:  # noqa: BLE001 - the asker's get() raises it
        answer(False, e)
        return
    answer(True, value)


def _spawn_procs(ctl: Jobs, op: SpawnProcs, owner: Owner | None) -> ProcsInfo:
    n = next(_unnamed) if not op.name else 0
    name = op.name or ("procs" if n == 0 else f"procs_{n}")
    env = {**dict(op.env or ()), "MONARCH_DEVICE": op.device}
    mesh = ctl.lifecycle.spawn(name, op.shape, launcher_of(op.launcher), env, op.host)
    mesh.owner = owner
    try:
        mesh.device = _device_of(mesh, op.device)
    except SpawnError:
        ctl.lifecycle.stop(mesh)
        raise
    return info_of(mesh)


def _device_of(mesh: Job, wanted: str) -> str:
    """The mesh's device type, as each of its workers decides it (bootstrap.mesh_device); a CUDA mesh where a
    rank has no GPU, or shares one unasked, or ranks that disagree, raise SpawnError."""
    per_host = Counter(mesh.hosts)
    devices = [mesh_device(wanted, g, per_host[h]) for g, h in zip(mesh.gpus, mesh.hosts, strict=True)]
    if len(set(devices)) > 1:
        r = devices.index("cpu")
        raise SpawnError(f"proc mesh {mesh.name!r}: rank {r} (host {mesh.hosts[r]}) has no GPU of its own ("
                         f"{mesh.gpus[r]} for {per_host[mesh.hosts[r]]} ranks there) while other ranks do; pass "
                         "spawn_procs(device='cpu'), or as many processes per host as each host has GPUs")
    if wanted != "cuda":
        return devices[0] if devices else "cpu"
    blind = [r for r, g in enumerate(mesh.gpus) if g == 0]
    if blind:
        raise SpawnError(f"spawn_procs(device='cuda'): rank {blind[0]} on host {mesh.hosts[blind[0]]} sees no GPU "
                         "(none there, or CUDA_VISIBLE_DEVICES hides them); spawn with device='cpu' or on hosts "
                         "with GPUs")
    crowded = [h for h, n in per_host.items() if n > mesh.gpus[mesh.hosts.index(h)]]
    if crowded and not config.share_gpus():
        h = crowded[0]
        raise SpawnError(f"spawn_procs(device='cuda'): {per_host[h]} processes on host {h}, which has "
                         f"{mesh.gpus[mesh.hosts.index(h)]} GPU(s); spawn at most one process per GPU, or set "
                         "MONARCH_SHARE_GPUS=1 to let them share (collectives then go through MPI)")
    return "cuda"


def _spawn_actors(ctl: Jobs, op: SpawnActors, owner: Owner | None) -> None:
    mesh = ctl.mesh(op.mesh_id)  # a stopped or failed mesh raises why
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


def _stop_procs(ctl: Jobs, op: StopProcs, owner: Owner | None) -> None:
    mesh = ctl.meshes.get(op.mesh_id)
    if mesh is not None:  # else stopped already: stopping is idempotent
        stop_tree(ctl, mesh)


def stop_tree(ctl: Jobs, mesh: Job) -> None:
    """Stop the proc meshes that actors of `mesh` spawned (theirs first), then `mesh`."""
    for child in [m for m in list(ctl.meshes.values()) if m.owner is not None and m.owner.mesh_id == mesh.id]:
        stop_tree(ctl, child)
    ctl.lifecycle.stop(mesh)


def _get_controller(ctl: Jobs, op: GetController, owner: Owner | None) -> ProcsInfo:
    """The one-process mesh that runs singleton actor mesh `op.name`: the running one, or a new one with
    the actors spawned on it (the client owns both, whoever asked)."""
    with _singletons_lock:
        mesh = ctl.meshes.get(_singletons.get(op.name, 0))
        if mesh is not None and mesh.live:
            return info_of(mesh)
        one = Shape.row_major(("procs",), (1,))
        info = _spawn_procs(ctl, SpawnProcs(f"controller_{op.name}", one, LOCAL), None)
        context = codec.loads(op.context)(info) if op.context else b""
        _spawn_actors(ctl, SpawnActors(info.mesh_id, SpawnActor(op.name, op.cls, op.args, one, context),
                                       op.cls_name), None)
        _singletons[op.name] = info.mesh_id
        return info


RUN: dict[type, Callable[[Jobs, Any, Owner | None], Any]] = {
    SpawnProcs: _spawn_procs, SpawnActors: _spawn_actors, StopProcs: _stop_procs, GetController: _get_controller}
