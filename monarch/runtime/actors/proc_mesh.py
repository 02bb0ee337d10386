"""Proc meshes on the controller (`ProcMesh`), and `monarch.sql` / `monarch.debug` over their telemetry.

A ProcMesh is a named-dim view of one MPI job (spawned by a HostMesh, host_mesh.py). Its dims are the
`per_host` dims, with a leading `hosts` dim when the host mesh has more than one host. Stopping any view
stops the whole job.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from monarch.errors import MeshError, SupervisionError
from monarch.runtime.actors.actor_mesh import ActorMesh
from monarch.runtime.actors.endpoint import endpoints_of
from monarch.runtime.actors.log_options import Applied, logging_option
from monarch.runtime.control import codec
from monarch.runtime.control.client import tensor_api
from monarch.runtime.control.commands import SpawnActor
from monarch.runtime.control.conn import Mesh
from monarch.runtime.control.controller import controller
from monarch.runtime.telemetry.events import RECORDER, now_us
from monarch.runtime.telemetry.store import STORE, Rows
from monarch.shape import MeshView, Shape

log = logging.getLogger("monarch")


def sql(query: str, timeout: float = 30.0) -> Rows:
    """Run SQL over the telemetry of this process and of every running mesh (`monarch.sql`)."""
    return controller().sql(query, timeout)


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


class ProcMesh(MeshView):
    """Worker processes with named dims; spawn actors on them, stop them when done."""

    def __init__(self, mesh: Mesh, shape: Shape) -> None:
        self._mesh = mesh
        self._shape = shape

    def _with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._mesh, shape)

    @property
    def name(self) -> str:
        return self._mesh.name

    def spawn(self, name: str, actor_cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Construct `actor_cls(*args, **kwargs)` on every proc of this view; returns at once."""
        table = endpoints_of(actor_cls)
        if name in self._mesh.actors:
            raise MeshError(f"proc mesh {self.name!r} already has actors named {name!r}; pick another name")
        msg = SpawnActor(name, codec.dumps(actor_cls), codec.dumps((args, kwargs)), self._shape)
        if not self._mesh.live:
            raise self._mesh.failure or SupervisionError(f"proc mesh {self.name!r} is stopped; spawn a new one")
        controller().fan_out(self._mesh, self._shape, codec.encode_frame([msg]),
                             f"spawning {name!r} (the pickled class and constructor arguments)")
        self._mesh.actors.add(name)
        now = now_us()
        for r in self._shape.ranks():
            RECORDER.add("actors", (r, self.name, name, actor_cls.__name__, now))
        return ActorMesh(self._mesh.id, name, actor_cls.__name__, frozenset(table), self._shape)

    def stop(self) -> None:
        """Stop every worker of the job (idempotent)."""
        controller().stop(self._mesh)

    @property
    def running(self) -> bool:
        """Neither stopped nor failed."""
        return self._mesh.live

    @property
    def hostnames(self) -> list[str]:
        """The host of each rank of this view, as the rank reported it, in row-major order."""
        return [self._mesh.hosts[r] for r in self._shape.ranks()]

    def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = 3,
                       level: int = logging.INFO) -> Applied:
        """Worker output of this job (stdout, stderr, logging at or above `level`): streamed to this console,
        identical lines of many ranks folded into one per `aggregate_window_sec` s window (`[dp=0..3] x4 loss
        0.5`; None: each line at once), or, with stream_to_client=False, kept off it (telemetry still has it).
        Returns a Future (`await` or `.get()`) done once every rank set its level (log_options.py)."""
        return logging_option(self, stream_to_client, aggregate_window_sec, level)

    def sync_workspace(self, path: str | os.PathLike[str], *, reload: bool = True) -> Any:
        """Copy directory `path` to the hosts of this mesh, first on the workers' `sys.path`, reloading the
        changed modules (monarch/cluster/workspace.py); returns a SyncReport."""
        from monarch.cluster.workspace import sync_workspace
        return sync_workspace(self, path, reload=reload)

    def run_spmd(self, script: str, args: Sequence[str] = (), *, timeout: float | None = None) -> None:
        """Run the torchrun-style `script` with `args` on every proc of this view, with RANK, WORLD_SIZE,
        MASTER_ADDR, ... set as torchrun sets them (monarch/spmd.py); raises the first rank's failure."""
        from monarch.spmd import run_spmd
        run_spmd(self, script, args, timeout=timeout)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers of this view, in row-major order."""
        return [self._mesh.pids[r] for r in self._shape.ranks()]

    def sql(self, query: str, timeout: float = 30.0) -> Rows:
        """Run SQL over the telemetry of this process (controller and every mesh), after fetching what
        this mesh's workers recorded (waiting up to `timeout` s; `Rows.late` names the ranks that did
        not answer in time). Tables: see README.md or monarch/runtime/telemetry.py."""
        return controller().sql(query, timeout, [self._mesh])

    def activate(self) -> Any:
        """Context manager: plain torch factories (torch.randn, torch.zeros, ...) create MeshTensors here."""
        return tensor_api().activate(self)

    def rank(self, dim: str) -> Any:
        """A MeshTensor of shape (size(dim),) sharded over `dim`: each rank holds its own index."""
        return tensor_api().rank(self, dim)

    def __enter__(self) -> ProcMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "failed" if self._mesh.failure else "stopped" if self._mesh.stopping else "running"
        return f"<ProcMesh {self.name!r} {self.extent} {state}>"
