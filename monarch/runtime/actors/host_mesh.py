"""Host meshes: hosts and the `Launcher` (runtime/control/launch.py) that starts ranks on them.

A HostMesh is given its launcher (forked here, or one of monarch/cluster: Hydra over ssh, srun in a Slurm
allocation, attach-mode agents; cluster/hosts.py has the HostMesh users name, which picks one); `spawn_procs`
starts one MPI job across them. Proc meshes of a mesh with more than one host get a leading `hosts` dim.
`sync_workspace` ships code to every host.
"""
from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from monarch import config
from monarch.errors import MeshError, SpawnError
from monarch.runtime.actors.actor_mesh import resolved
from monarch.runtime.actors.context import context
from monarch.runtime.actors.endpoint import Actor, endpoint
from monarch.runtime.actors.proc_mesh import Hold, ProcMesh, ask
from monarch.runtime.control import launch
from monarch.runtime.control.bootstrap import visible_gpus
from monarch.runtime.control.handlers import requests
from monarch.runtime.control.client import client
from monarch.runtime.control.commands import SpawnProcs
from monarch.runtime.control.controller import controller
from monarch.runtime.control.futures import Future
from monarch.shape import MeshView, Shape

SPAWN_SLACK_S = 10.0  # beyond MONARCH_SPAWN_TIMEOUT, what an actor waits for the controller to start its mesh
STOP_TIMEOUT_S = 30.0  # what shutdown() waits for each proc mesh an actor asked the controller to stop


class HostMesh(MeshView):
    """Hosts that can run workers, each rank started by `launcher`. `this_host()` is this one host.

    A HostMesh pickles as a reference (its class, its hosts and the controller's key for its launcher):
    inside an actor, `spawn_procs` asks the controller to start the job, and the asking actor owns it."""

    def __init__(self, hosts: list[str], launcher: launch.Launcher) -> None:
        if not hosts:
            raise MeshError("a HostMesh needs at least one host")
        if len(set(hosts)) != len(hosts):
            raise MeshError(f"a HostMesh names each host once; got {hosts}")
        self._hosts = list(hosts)
        self._shape = Shape.row_major(("hosts",), (len(hosts),))
        self._launcher: launch.Launcher | None = launcher
        self._local = self._launcher.local
        self._key: int | None = None  # the launcher's key in the controller (requests.keep_launcher)
        self._procs: weakref.WeakSet[ProcMesh] = weakref.WeakSet()
        self._workspaces: list[tuple[Path, bool]] = []

    @classmethod
    def _reference(cls, hosts: list[str], key: int, local: bool) -> HostMesh:
        """A HostMesh unpickled: the launcher is the controller's (here only in the controller's process)."""
        mesh = cls.__new__(cls)
        mesh._hosts, mesh._shape = list(hosts), Shape.row_major(("hosts",), (len(hosts),))
        mesh._launcher = requests.launcher_of(key) if client().is_controller else None
        mesh._local, mesh._key = local, key
        mesh._procs, mesh._workspaces = weakref.WeakSet(), []
        return mesh

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self)._reference, (self._hosts, self._launcher_key(), self._local))

    def _launcher_key(self) -> int:
        if self._key is None:
            assert self._launcher is not None
            if type(self._launcher) is not launch.LocalLauncher and not client().is_controller:
                raise MeshError(f"a HostMesh over {self._hosts} can be made on the controller only; inside an actor "
                                "use this_host(), or a HostMesh the client passed to the actor")
            self._key = requests.keep_launcher(self._launcher)
        return self._key

    @property
    def hostnames(self) -> list[str]:
        return list(self._hosts)

    def _with_shape(self, shape: Shape) -> HostMesh:
        hosts = [self._hosts[r] for r in shape.ranks()]
        if self._launcher is None:
            raise MeshError(f"slicing a HostMesh reference inside an actor is not supported ({self._hosts}); "
                            "slice it on the client and pass the slice")
        return type(self)(hosts, self._launcher.subset(hosts))

    def spawn_procs(self, per_host: dict[str, int] | None = None,
                    bootstrap: Callable[[], None] | Callable[[], Awaitable[None]] | None = None, *,
                    name: str | None = None, env: dict[str, str] | None = None, host: str | None = None,
                    device: str | None = None) -> ProcMesh:
        """Start one worker per point of `per_host` on every host, as one MPI job, named `name` (default:
        procs, procs_1, procs_2, ... in the order they start).

        `env` adds environment variables for the workers. `host` is the address the controller's control
        socket binds to for this mesh (default MONARCH_HOST; else loopback for this host alone, and this
        host's address on the route to the first host otherwise); workers are told MONARCH_ADVERTISE, or
        that address (the route's when `host` is a wildcard such as 0.0.0.0). Inside an actor the
        controller starts it, and that actor owns it (stopping the actor's mesh stops it too).

        `bootstrap` (as Monarch's) runs in every process before spawn_procs returns, before any actor or tensor:
        the place to set per-process environment such as CUDA_VISIBLE_DEVICES from `current_rank()`; a
        coroutine function is awaited. Its exception fails the spawn (the mesh is stopped).

        `device` is the device type of the mesh's tensors (`procs.device`): "cuda" binds each worker to a GPU
        of its host (its local rank's, among those CUDA_VISIBLE_DEVICES shows), "cpu" keeps tensors in host
        memory; the default (MONARCH_DEVICE, else auto) is cuda where each process of a host can have a GPU
        of its own, cpu otherwise.
        """
        shape = self._procs_shape(dict(per_host or {"gpus": 1}))
        _check_local_size(shape, self._local)
        wanted = _device(device, shape, self._local)
        op = SpawnProcs(name or "", shape, self._launcher_key(), tuple(env.items()) if env is not None else None,
                        host, device=wanted)
        info = ask(op).get(config.spawn_timeout() + SPAWN_SLACK_S)
        procs = ProcMesh(info, hold=Hold(info) if client().is_controller else None)
        if bootstrap is not None:
            _bootstrap(procs, bootstrap)
        self._procs.add(procs)
        for path, reload in self._workspaces:
            procs.sync_workspace(path, reload=reload)
        return procs

    def _procs_shape(self, per_host: dict[str, int]) -> Shape:
        """The proc mesh's shape: the per_host dims, after a leading `hosts` dim when there is more than one
        host (a per_host dim of that name then clashes with it)."""
        labels, sizes = tuple(per_host), tuple(int(n) for n in per_host.values())
        if len(self._hosts) > 1:
            if "hosts" in per_host:
                raise MeshError(f"per_host {per_host} names a dim 'hosts', which this mesh of {len(self._hosts)} "
                                "hosts adds itself as the leading dim; rename that per_host dim (e.g. 'procs')")
            labels, sizes = ("hosts", *labels), (len(self._hosts), *sizes)
        return Shape.row_major(labels, sizes)

    def sync_workspace(self, path: str | os.PathLike[str], *, reload: bool = True) -> list[Any]:
        """Copy directory `path` to every host of this mesh, first on the workers' `sys.path`, reloading
        changed modules; only files whose content changed travel. Proc meshes spawned later get it at
        spawn. Returns one SyncReport per running proc mesh."""
        root = Path(path).resolve()
        self._workspaces = [w for w in self._workspaces if w[0] != root] + [(root, reload)]
        return [p.sync_workspace(root, reload=reload) for p in list(self._procs) if p.running]

    def shutdown(self) -> Future[None]:
        """Stop every proc mesh spawned from this host mesh and give its hosts back (attach-mode agents go
        back to waiting for a controller). On a slice: the proc meshes spawned from it, and its hosts.
        Returns a Future, done once they stopped (`await` it or `.get()`); idempotent."""
        for stopping in [procs.stop() for procs in list(self._procs)]:
            stopping.get(STOP_TIMEOUT_S)
        if self._launcher is not None and client().is_controller:
            self._launcher.release()
        return resolved(None)

    def __repr__(self) -> str:
        return f"<HostMesh {self._hosts}>"


def _check_local_size(shape: Shape, local: bool) -> None:
    """Refuse a mesh on this host alone with more processes than MONARCH_MAX_LOCAL_PROCS, before mpiexec."""
    limit = config.max_local_procs()
    if local and len(shape) > limit:
        raise SpawnError(f"a mesh of {len(shape)} worker processes ({shape.extent}) on this host is over the "
                         f"limit of {limit} (MONARCH_MAX_LOCAL_PROCS, default 16 per core; this host has "
                         f"{os.cpu_count()} cores): spawn fewer processes, or raise MONARCH_MAX_LOCAL_PROCS")


class _Bootstrap(Actor):
    """Runs a spawn's bootstrap callable in its process."""

    @endpoint
    async def run(self, fn: Callable[[], Any]) -> None:
        out = fn()
        if inspect.isawaitable(out):
            await out


def _bootstrap(procs: ProcMesh, fn: Callable[[], Any]) -> None:
    try:
        procs.spawn("_bootstrap", _Bootstrap).run.call(fn).get(config.spawn_timeout() + SPAWN_SLACK_S)
    except BaseException:
        procs.stop().get(STOP_TIMEOUT_S)
        raise


def _device(device: str | None, shape: Shape, local: bool) -> str:
    """spawn_procs's device, checked: a CUDA mesh on this host alone needs a GPU here (checked before mpiexec)."""
    wanted = config.device() if device is None else str(device).lower().split(":")[0]  # also a torch.device
    if wanted not in ("auto", "cpu", "cuda"):
        raise SpawnError(f"spawn_procs(device={device!r}): the device type is 'cpu' or 'cuda' (or None: cuda where "
                         "each process can have a GPU of its own)")
    if wanted == "cuda" and local and visible_gpus() == 0:
        raise SpawnError(f"spawn_procs(device='cuda') of {len(shape)} processes: this host has no GPU that CUDA "
                         "may use (no NVIDIA device, or CUDA_VISIBLE_DEVICES hides them); use device='cpu' (or "
                         "leave it unset), or spawn on hosts with GPUs")
    return wanted


def this_host() -> HostMesh:
    """The machine the controller runs on, its ranks forked by mpiexec."""
    return HostMesh(["localhost"], launch.LocalLauncher())


_this_proc: list[ProcMesh] = []  # the client's one-process mesh of this_proc()


def this_proc() -> ProcMesh:
    """The proc mesh of this process's one proc: inside an actor, its own process; on the client, a
    one-process mesh on this host, spawned on first use (actors cannot run inside the client here)."""
    if not client().is_controller:
        return context().actor_instance.proc
    if not _this_proc or not _this_proc[0].running:
        _this_proc[:] = [this_host().spawn_procs(name="this_proc")]
    return _this_proc[0]


# -- Monarch's older spellings ----------------------------------------------------------------------
def proc_mesh(*, gpus: int | None = None, hosts: int = 1, env: dict[str, str] | None = None) -> ProcMesh:
    """Monarch's `proc_mesh(gpus=, hosts=)` (deprecated there too): `this_host().spawn_procs(per_host=
    {"hosts": hosts, "gpus": gpus})`, one host's worth of processes per `hosts` on this machine."""
    return this_host().spawn_procs(per_host={"hosts": hosts, "gpus": gpus or _local_devices()}, env=env)


def local_proc_mesh(*, gpus: int | None = None, hosts: int = 1) -> ProcMesh:
    """A proc mesh on this machine (Monarch's name for `proc_mesh` with local processes)."""
    return proc_mesh(gpus=gpus, hosts=hosts)


def sim_proc_mesh(*, gpus: int | None = None, hosts: int = 1) -> ProcMesh:
    """Monarch simulates a mesh's processes here; these are real local processes with the same dims."""
    return proc_mesh(gpus=gpus, hosts=hosts)


def _local_devices() -> int:
    """The CUDA devices this host shows (CUDA_VISIBLE_DEVICES, else nvidia's device files), at least 1."""
    return max(1, visible_gpus())


def shutdown_context() -> Future[None]:
    """Stop every proc mesh this client started (Monarch's shutdown of the client's context); idempotent."""
    if client().is_controller:
        ctl = controller()
        for mesh in list(ctl.meshes.values()):
            ctl.lifecycle.stop(mesh)
    return resolved(None)
