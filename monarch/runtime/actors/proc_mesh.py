"""Proc meshes (`ProcMesh`), and `monarch.sql` / `monarch.debug` over their telemetry.

A ProcMesh is a named-dim view of one MPI job (spawned by a HostMesh, host_mesh.py). Its dims are the
`per_host` dims, with a leading `hosts` dim when the host mesh has more than one host. Stopping any view
stops the whole job. It is a reference that pickles: inside an actor it spawns and stops through the
controller (`ask`, control/handlers/requests.py).
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import import_module
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from monarch.errors import MeshError, SupervisionError
from monarch.runtime.actors.actor_mesh import HOLDS, ActorMesh, resolved
from monarch.runtime.actors.context import context
from monarch.runtime.actors.endpoint import Actor, endpoints_of
from monarch.runtime.actors.log_options import Applied, logging_option
from monarch.runtime.control import codec
from monarch.runtime.control.client import client, tensor_api
from monarch.runtime.control.commands import MeshRequest, ProcsInfo, SpawnActor, SpawnActors, StopProcs
from monarch.runtime.control.futures import CallState, Future, one_result
from monarch.runtime.telemetry.store import STORE, Limits, Rows
from monarch.shape import DeviceMeshNames, MeshView, Shape

if TYPE_CHECKING:
    from monarch.runtime.control.conn import Job
    from monarch.runtime.control.controller import Controller

log = logging.getLogger("monarch")
A = TypeVar("A", bound=Actor)
REQUEST_TIMEOUT = 60.0  # seconds an actor waits for the controller to spawn actors for it
WORKSPACE = "monarch.cluster.workspace"  # the declared doorways up: ProcMesh.sync_workspace and ProcMesh.run_spmd
SPMD = "monarch.spmd"  # reach these modules on first use, so that the actor layer imports neither


def sql(query: str, timeout: float = 30.0, query_timeout: float | None = None) -> Rows:
    """Run SQL over the telemetry of this process and of every running mesh (`monarch.sql`); see ProcMesh.sql."""
    return _controller().telemetry.sql(query, timeout, limits=Limits(query_timeout))


def debug(n: int = 20, rank: int | None = None, timeout: float = 30.0) -> Rows:
    """Print (and return) the last `n` events of the rank of the latest failure (or of `rank`) up to that
    failure: its messages, programs, collectives, log lines and failures, newest first."""
    fail = sql("SELECT rank, time_us FROM failures ORDER BY time_us DESC LIMIT 1", timeout)
    who = rank if rank is not None else (fail[0][0] if fail else 0)
    until = fail[0][1] + 1_000_000 if fail else 1 << 62
    rows = STORE.sql(f"""
        SELECT time_us, kind, what FROM (
            SELECT end_us AS time_us, 'message' AS kind, actor || '.' || endpoint || ' ' || status AS what, rank
              FROM messages
            UNION ALL SELECT end_us, 'program', op || ' ' || program || ' (' || instructions || ' instructions)', rank
              FROM ops
            UNION ALL SELECT start_us, 'collective', kind || ' over mesh dim ' || mdim, rank FROM collectives
            UNION ALL SELECT time_us, 'log', stream || ' ' || level || ': ' || text, rank FROM logs
            UNION ALL SELECT time_us, 'failure', kind || ' ' || what || ' ' || detail, rank FROM failures)
        WHERE rank = {int(who)} AND time_us <= {until} ORDER BY time_us DESC LIMIT {int(n)}""")
    print(f"last {len(rows)} events of rank {who}" + (" up to its failure" if fail and rank is None else ""))
    for t, kind, what in rows:
        print(f"  {t}  {kind:10}  {what}")
    return rows


class ProcMesh(DeviceMeshNames, MeshView):
    """Worker processes with named dims; spawn actors on them, stop them when done.

    A ProcMesh is a reference: it pickles (mesh id, name, shape, hosts, pids), so an actor given one can
    spawn actors on it and call them; inside an actor, spawning and stopping are asked of the controller
    (control/handlers/requests.py). On the controller `_mesh` is the job's record; inside an actor it is None.
    """

    def __init__(self, info: ProcsInfo, shape: Shape | None = None, mesh: Job | None = None,
                 hold: Hold | None = None) -> None:
        self._info = info
        self._shape = info.shape if shape is None else shape
        self._mesh = mesh if mesh is not None else _record(info.mesh_id)
        self._hold = hold or HOLDS.get(info.mesh_id)  # a mesh the client spawned runs while a view holds this

    def _with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._info, shape, self._mesh)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcMesh, (self._info, self._shape))

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def mesh_id(self) -> int:
        """The job's id, shared by every view of it."""
        return self._info.mesh_id

    @property
    def device(self) -> str:
        """The device type of the mesh's tensors: "cuda" (each worker bound to a GPU) or "cpu"."""
        return self._info.device

    @property
    def max_frame(self) -> int:
        """The largest frame the job's workers accept (known on the controller)."""
        assert self._mesh is not None, f"max_frame of {self.name!r} outside the controller"
        return self._mesh.max_frame

    def keep_while_held(self, obj: object) -> None:
        """Keep `obj` alive while the mesh is held, not beyond (a mesh nothing refers to stops)."""
        if self._hold is not None:
            self._hold.sessions.append(obj)

    @property
    def initialized(self) -> Future[Literal[True]]:
        """Done (True) once the processes are up: spawn_procs returns when every worker connected."""
        return resolved(True)

    def spawn(self, name: str, actor_cls: type[A], *args: Any, **kwargs: Any) -> A:
        """Construct `actor_cls(*args, **kwargs)` on every proc of this view; returns at once (an actor's
        calls run after its __init__; `initialized` waits for it)."""
        table = endpoints_of(actor_cls)
        creator = None if client().is_controller else context().actor_instance.as_creator()
        extra = codec.dumps({"creator": creator, "proc_mesh": self})  # what the actors' context() tells
        msg = SpawnActor(name, codec.dumps(actor_cls), codec.dumps((args, kwargs)), self._shape, extra)
        ask(SpawnActors(self._info.mesh_id, msg, actor_cls.__name__)).get(REQUEST_TIMEOUT)
        mesh: ActorMesh[A] = ActorMesh(self._info.mesh_id, name, actor_cls.__name__, frozenset(table), self._shape)
        return cast(A, mesh)  # an ActorMesh[A], which a type checker sees as its actor class (as in Monarch)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every worker of the job, and the proc meshes its actors spawned (idempotent). Done at once
        on the controller; inside an actor, once the controller stopped them (`await` it or `.get()`)."""
        return ask(StopProcs(self._info.mesh_id))

    @property
    def running(self) -> bool:
        """Neither stopped nor failed (on the controller)."""
        if self._mesh is None and not client().is_controller:
            raise MeshError(f"ProcMesh.running of {self.name!r} is known on the controller only; inside an actor, "
                            "call the mesh's actors (a stopped mesh raises SupervisionError)")
        return self._mesh is not None and self._mesh.live

    @property
    def hostnames(self) -> list[str]:
        """The host of each rank of this view, as the rank reported it, in row-major order."""
        hosts = self._mesh.hosts if self._mesh is not None else self._info.hosts
        return [hosts[r] for r in self._shape.ranks()]

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers of this view, in row-major order."""
        pids = self._mesh.pids if self._mesh is not None else self._info.pids
        return [pids[r] for r in self._shape.ranks()]

    def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = 3,
                       level: int = logging.INFO) -> Applied:
        """Worker output of this job (stdout, stderr, logging at or above `level`): streamed to this console,
        identical lines of many ranks folded into one per `aggregate_window_sec` s window (`[dp=0..3] x4 loss
        0.5`; None: each line at once), or, with stream_to_client=False, kept off it (telemetry still has it).
        Returns a Future (`await` or `.get()`) done once every rank set its level (log_options.py)."""
        return logging_option(self._here("logging_option"), stream_to_client, aggregate_window_sec, level)

    def sync_workspace(self, path: str | os.PathLike[str], *, reload: bool = True) -> Any:
        """Copy directory `path` to the hosts of this mesh, first on the workers' `sys.path`, reloading the
        changed modules (monarch/cluster/workspace.py); returns a SyncReport."""
        return import_module(WORKSPACE).sync_workspace(self._here("sync_workspace"), path, reload=reload)

    def run_spmd(self, script: str, args: Sequence[str] = (), *, timeout: float | None = None) -> None:
        """Run the torchrun-style `script` with `args` on every proc of this view, with RANK, WORLD_SIZE,
        MASTER_ADDR, ... set as torchrun sets them (monarch/spmd.py); raises the first rank's failure."""
        import_module(SPMD).run_spmd(self, script, args, timeout=timeout)

    def sql(self, query: str, timeout: float = 30.0, query_timeout: float | None = None) -> Rows:
        """Run SQL over the telemetry of this process (controller and every mesh), after fetching what
        this mesh's workers recorded (waiting up to `timeout` s; `Rows.late` names the ranks that did
        not answer in time). The query itself runs for up to `query_timeout` s (default
        MONARCH_QUERY_TIMEOUT; 0: no limit), then raises QueryTimeout. Tables: see README.md."""
        return _controller().telemetry.sql(query, timeout, [self._here("sql")._mesh], Limits(query_timeout))

    def activate(self) -> Any:
        """Context manager: plain torch factories (torch.randn, torch.zeros, ...) create MeshTensors here."""
        return tensor_api().activate(self._here("activate"))

    def rank(self, dim: str) -> Any:
        """A MeshTensor of shape (size(dim),) sharded over `dim`: each rank holds its own index."""
        return tensor_api().rank(self._here("rank"), dim)

    def _here(self, what: str) -> ProcMesh:
        """This mesh, where its job's record is (the controller); else a MeshError naming `what`."""
        if self._mesh is None:
            raise MeshError(f"ProcMesh.{what} of {self.name!r} works on the controller only (this reference is "
                            "inside an actor, or its mesh is stopped); call it from the client")
        return self

    def keep_after_with(self) -> ProcMesh:
        """Leave the mesh running at the end of its `with` blocks, as DTensor's DeviceMesh (init_device_mesh's
        meshes are made so); it stops at `procs.stop()`, once unreferenced, or at interpreter exit."""
        _KEPT.add(self.mesh_id)
        return self

    def __exit__(self, *exc: object) -> None:
        """`with procs:` makes procs the default mesh of monarch.dtensor inside the block (DeviceMeshNames)
        and stops it at the end, unless it was made by init_device_mesh (`keep_after_with`)."""
        super().__exit__(*exc)
        if self.mesh_id in _KEPT:
            return
        running = self._mesh is not None and self._mesh.live
        self.stop()
        if running:
            _controller().lifecycle.ended[self.mesh_id] = SupervisionError(
                f"mesh {self.name!r} was stopped at the end of its `with` block: a mesh from spawn_procs stops "
                "there (Monarch's lifecycle); to use its tensors after the block, make the mesh with "
                "monarch.dtensor.init_device_mesh (its `with` block only sets the default mesh) or keep it "
                "running: spawn it outside a `with` block and call procs.stop() when done")

    def __repr__(self) -> str:
        mesh = self._mesh
        state = ("reference" if mesh is None else "failed" if mesh.failure else "stopped" if mesh.stopping
                 else "running")
        return f"<ProcMesh {self.name!r} {self.extent} {state}>"


class Hold:
    """Keeps a proc mesh the client spawned running: every ProcMesh and ActorMesh of it on the client holds
    it (actor_mesh.HOLDS). When the last of them is gone, the mesh stops, with a one-line warning."""

    def __init__(self, info: ProcsInfo) -> None:
        HOLDS[info.mesh_id] = self
        self.sessions: list[Any] = []  # the tensor API's sessions of this mesh's views live while it is held
        weakref.finalize(self, _unreferenced, info.mesh_id).atexit = False  # at exit, shutdown stops it


def _unreferenced(mesh_id: int) -> None:
    """The last reference to a proc mesh of the client is gone: stop it on a thread (a finalizer runs
    wherever the collector ran, perhaps while this thread polls)."""
    mesh = _record(mesh_id)
    if mesh is None or mesh.stopping:
        return
    if mesh.live:
        log.warning("monarch: proc mesh %r is stopped: the last reference to it (a ProcMesh or ActorMesh) is gone; "
                    "stop meshes with procs.stop() or a `with` block", mesh.name)
    from monarch.runtime.control.handlers.requests import stop_tree
    threading.Thread(target=stop_tree, args=(_controller(), mesh), name="monarch-unreferenced",
                     daemon=True).start()


def _record(mesh_id: int) -> Job | None:
    """The controller's record of a job, in the controller's process while the job runs."""
    return _controller().meshes.get(mesh_id) if client().is_controller else None


def _controller() -> Controller:
    """This process's controller, its module loaded on first use: a worker unpickles a ProcMesh for every actor
    it spawns (the actor's context), and loading the controller's modules there cost each worker's start-up."""
    from monarch.runtime.control.controller import controller
    return controller()


def ask(op: MeshRequest, result: Callable[[CallState], Any] = one_result) -> Future[Any]:
    """Make mesh request `op` (control/handlers/requests.py): run at once on the controller; from a worker, sent to the
    controller in the running actor's name (then the Future is done when the controller answered). `result`
    makes the Future's value of the answer."""
    c = client()
    op = replace(op, call_id=c.next_call_id())
    state = CallState(_SINGLETON, f"{type(op).__name__} (asked of the controller)")
    c.ask(op, state)
    return Future(state, c, result)


_SINGLETON = Shape.row_major((), ())
_KEPT: set[int] = set()  # ids of the proc meshes that outlive their `with` blocks (keep_after_with)
