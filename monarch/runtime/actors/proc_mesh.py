"""Host and proc meshes on the controller: `this_host()`, `HostMesh.spawn_procs`, `ProcMesh`.

A ProcMesh is a named-dim view of one MPI job. Its dims are the `per_host` dims, with a leading
`hosts` dim when the host mesh has more than one host. Stopping any view stops the whole job.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from monarch import config
from monarch.errors import MeshError, SpawnError, SupervisionError
from monarch.runtime.actors.actor_mesh import ActorMesh
from monarch.runtime.actors.endpoint import endpoints_of
from monarch.runtime.control import codec, launch
from monarch.runtime.control.client import tensor_api
from monarch.runtime.control.commands import SpawnActor
from monarch.runtime.control.conn import Mesh
from monarch.runtime.control.controller import controller
from monarch.runtime.telemetry.events import RECORDER, now_us
from monarch.runtime.telemetry.store import STORE, Rows
from monarch.shape import MeshView, Shape

log = logging.getLogger("monarch")


class HostMesh(MeshView):
    """Hosts that can run workers. `this_host()` is one host whose dim is dropped from proc meshes."""

    def __init__(self, hosts: list[str]) -> None:
        if not hosts:
            raise MeshError("a HostMesh needs at least one host")
        self._hosts = list(hosts)
        self._shape = Shape.row_major(("hosts",), (len(hosts),))

    def _with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh([self._hosts[r] for r in shape.ranks()])

    def spawn_procs(self, per_host: dict[str, int] | None = None, *, name: str = "procs",
                    env: dict[str, str] | None = None, host: str | None = None) -> ProcMesh:
        """Start one worker per point of `per_host` on every host, as one MPI job.

        `env` adds environment variables for the workers; `host` is the address the controller's
        control socket binds to for this mesh (default MONARCH_HOST, loopback); set it to an address
        the other hosts can reach when the mesh spans hosts.
        """
        per_host = dict(per_host or {"gpus": 1})
        if "hosts" in per_host:
            raise MeshError("per_host may not name a dim 'hosts'; that dim is the host mesh's own")
        labels, sizes = tuple(per_host), tuple(int(n) for n in per_host.values())
        if len(self._hosts) > 1:
            labels, sizes = ("hosts", *labels), (len(self._hosts), *sizes)
        shape = Shape.row_major(labels, sizes)
        _check_local_size(shape, self._hosts)
        mesh = controller().spawn(name, shape, self._hosts, env, host)
        return ProcMesh(mesh, shape)

    def __repr__(self) -> str:
        return f"<HostMesh {self._hosts}>"


def _check_local_size(shape: Shape, hosts: list[str]) -> None:
    """Refuse a mesh on this host alone with more processes than MONARCH_MAX_LOCAL_PROCS, before mpiexec."""
    limit = config.max_local_procs()
    if launch.all_local(hosts) and len(shape) > limit:
        raise SpawnError(f"a mesh of {len(shape)} worker processes ({shape.extent}) on this host is over the "
                         f"limit of {limit} (MONARCH_MAX_LOCAL_PROCS, default 16 per core; this host has "
                         f"{os.cpu_count()} cores): spawn fewer processes, or raise MONARCH_MAX_LOCAL_PROCS")


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


def this_host() -> HostMesh:
    """The machine the controller runs on."""
    return HostMesh(["localhost"])


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
