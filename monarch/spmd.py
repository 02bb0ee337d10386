"""torchrun-style SPMD scripts on a proc mesh: `SPMDActor`, `setup_torch_elastic_env` and `run_spmd`.

Every rank gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...),
so `torch.distributed.init_process_group()` (env://) and DDP work unchanged; `run_spmd` then runs the
script itself in each worker process, as `python script.py args` would, and restores the process after.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import runpy
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch.errors import MonarchError
from monarch.runtime.actors.endpoint import Actor, endpoint
from monarch.runtime.control.client import current_rank, current_size

__all__ = ["SPMDActor", "SPMDError", "run_spmd", "setup_torch_elastic_env", "setup_torch_elastic_env_async"]

LOOPBACK = "127.0.0.1"  # MASTER_ADDR when every rank runs on one host
SETUP_TIMEOUT_S = 60.0  # bound of the short setup calls (free port, environment)
POLL_S = 0.2  # how soon run_spmd notices one rank's failure while others still run
_ids = itertools.count()


class SPMDError(MonarchError, RuntimeError):
    """An SPMD script could not be run as asked, or exited with a nonzero status."""


@dataclass(frozen=True)
class Topology:
    """Where one rank sits, in torchrun's terms: nodes are hosts, local ranks count within a host."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int

    @staticmethod
    def of(rank: int, world_size: int, hosts: Sequence[str] | None, sizes: dict[str, int],
           last_dim: str | None) -> Topology:
        """From the hosts of the view (row-major), or else, as Monarch does, the last dim as the local one."""
        if hosts is not None:
            assert len(hosts) == world_size, f"{len(hosts)} hosts for {world_size} ranks"
            nodes = list(dict.fromkeys(hosts))
            host = hosts[rank]
            return Topology(rank, world_size, list(hosts[:rank]).count(host), list(hosts).count(host),
                            nodes.index(host), len(nodes))
        local = sizes[last_dim] if last_dim is not None else 1
        return Topology(rank, world_size, rank % local, local, rank // local, -(-world_size // local))

    def env(self, master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
        """The variables torchrun sets for its workers (NODE_RANK too, which other launchers read)."""
        values = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
                  "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.group_rank,
                  "NODE_RANK": self.group_rank, "GROUP_WORLD_SIZE": self.group_world_size,
                  "ROLE_RANK": self.rank, "ROLE_WORLD_SIZE": self.world_size, "ROLE_NAME": "default",
                  "MASTER_ADDR": master_addr, "MASTER_PORT": master_port, "TORCHELASTIC_RUN_ID": run_id,
                  "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
                  "TORCHELASTIC_USE_AGENT_STORE": False}
        return {k: str(v) for k, v in values.items()}


@dataclass
class Saved:
    """What running a script changes in this process: environment, argv, sys.path, cwd, new local modules."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    path: list[str] = field(default_factory=lambda: list(sys.path))
    cwd: str = field(default_factory=os.getcwd)
    modules: frozenset[str] = field(default_factory=lambda: frozenset(sys.modules))
    process_group: bool = field(default_factory=lambda: _process_group_initialized())

    def restore(self, script_dir: str | None) -> None:
        """Undo the script's changes; destroy a default process group it left initialised."""
        if self.process_group is False and _process_group_initialized():
            try:
                sys.modules["torch.distributed"].destroy_process_group()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - a broken group must not hide the script's outcome
                print(f"monarch.spmd: could not destroy the script's process group: {e!r}", file=sys.stderr)
        for key in [k for k in os.environ if k not in self.env]:
            del os.environ[key]
        os.environ.update({k: v for k, v in self.env.items() if os.environ.get(k) != v})
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        os.chdir(self.cwd)
        if script_dir is not None:
            for name in [n for n in sys.modules if n.partition(".")[0] not in self.modules]:
                if _defined_under(sys.modules[name], script_dir):
                    del sys.modules[name]  # the script's own modules: the next run imports them afresh


def _process_group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _defined_under(module: Any, folder: str) -> bool:
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and os.path.abspath(path).startswith(folder + os.sep)


def _address(use_ipaddr: Any) -> str:
    """This host's name, or with `use_ipaddr` ("ipv4"/"ipv6" or Monarch's AddrType) its address, preferring
    one that other hosts can reach over a loopback one."""
    host = socket.gethostname()
    if use_ipaddr is None:
        return host
    family = socket.AF_INET6 if "6" in str(getattr(use_ipaddr, "name", use_ipaddr)) else socket.AF_INET
    try:
        found = [info[4][0] for info in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)]
    except socket.gaierror as e:
        raise SPMDError(f"host {host!r} has no {family.name} address ({e}); pass use_ipaddr=None to advertise "
                        "its name, or give master_addr yourself") from e
    routable = [a for a in found if not (a.startswith("127.") or a == "::1")]
    return (routable or found)[0]


class SPMDActor(Actor):
    """Sets up torchrun's environment on its rank and runs SPMD training scripts there (Monarch's names).

    `hosts`: the host of each rank of the view, row-major (`ProcMesh.hostnames`); local ranks then count
    within a host, as torchrun's do. Without it the last mesh dim is the local one, as in Monarch.
    """

    def __init__(self, hosts: Sequence[str] | None = None) -> None:
        point = current_rank()
        sizes = current_size()
        last = point.extent.labels[-1] if point.extent.labels else None
        self.topology = Topology.of(point.rank, math.prod(sizes.values()), hosts, sizes, last)
        self._held: socket.socket | None = None  # the free port picked by get_host_port, held until used

    @endpoint
    def get_host_port(self, use_ipaddr: Any = None) -> tuple[str, int]:
        """A free port of this host (held until this actor sets up the environment) and this host's address."""
        self._release()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("", 0))
        self._held = sock
        return _address(use_ipaddr), sock.getsockname()[1]

    @endpoint
    def setup_env(self, master_addr: str, master_port: int, run_id: str = "none") -> None:
        """Set torchrun's variables in this process, for init_process_group() in later endpoints."""
        self._release()
        os.environ.update(self.topology.env(master_addr, master_port, run_id))

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: Sequence[str], run_id: str = "none") -> bool:
        """Run `script_args` ([script, *args] or ["-m", module, *args]) here with torchrun's environment,
        as `python script args` would; True when it returns or exits with status 0. Environment, argv,
        sys.path and cwd are restored afterwards, and a process group the script left is destroyed."""
        if not script_args or list(script_args)[:1] == ["-m"] and len(script_args) < 2:
            raise SPMDError(f"no script to run in {list(script_args)!r}; pass [script, *args] or "
                            "['-m', module, *args]")
        saved, script_dir = Saved(), None
        try:
            os.environ.update(self.topology.env(master_addr, master_port, run_id))
            self._release()
            workspace = os.environ.get("WORKSPACE_DIR")  # a synced workspace (Monarch's), where paths start
            if workspace and os.path.isdir(workspace):
                os.chdir(workspace)
            script_dir = None if script_args[0] == "-m" else os.path.dirname(os.path.abspath(script_args[0]))
            _run(list(script_args), script_dir)
        except SystemExit as e:
            if e.code not in (None, 0):
                status = e.code if isinstance(e.code, int) else 1
                raise SPMDError(f"{' '.join(script_args)} exited with status {status} on rank "
                                f"{self.topology.rank}" + ("" if isinstance(e.code, int) else f": {e.code}")) from None
        finally:
            saved.restore(script_dir)
        return True

    @endpoint
    def run_command(self, entrypoint: str, args: Sequence[str], env: dict[str, str]) -> bool:
        """Run `entrypoint args` (such as a whole torchrun command) as a child process with `env` added to
        this process's environment; True on status 0, else SPMDError naming the status."""
        import subprocess
        done = subprocess.run([entrypoint, *args], env={**os.environ, **env}, check=False)
        if done.returncode != 0:
            raise SPMDError(f"{entrypoint} {' '.join(args)} exited with status {done.returncode} on rank "
                            f"{self.topology.rank}")
        return True

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


def _run(script_args: list[str], script_dir: str | None) -> None:
    if script_dir is None:
        sys.argv[:] = [script_args[1], *script_args[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(script_args[1], run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(script_args[0]):
        raise SPMDError(f"script {script_args[0]!r} not found on host {socket.gethostname()} (cwd "
                        f"{os.getcwd()}); give a path the workers can read, or sync it with procs.sync_workspace")
    sys.argv[:] = script_args
    sys.path.insert(0, script_dir)
    runpy.run_path(script_args[0], run_name="__main__")


def _spawn(proc_mesh: Any) -> Any:
    """An SPMDActor on every proc of the view, told the hosts so that local ranks count per host."""
    return proc_mesh.spawn(f"_SPMDActor_{next(_ids)}", SPMDActor, list(proc_mesh.hostnames))


def _points(view: Any) -> list[Any]:
    """One single-actor view per point of `view`, in row-major order (any slice, strided or not)."""
    labels, sizes = view.extent.labels, view.extent.sizes
    return [view.slice(**dict(zip(labels, c, strict=True))) for c in itertools.product(*map(range, sizes))]


def _rank_zero(actors: Any) -> Any:
    return actors.slice(**dict.fromkeys(actors.extent.labels, 0))


def _master(actors: Any, hosts: list[str], use_ipaddr: Any) -> tuple[str, int]:
    """Rank 0's free port, with its address (the loopback one when all ranks share its host)."""
    addr, port = _rank_zero(actors).get_host_port.call_one(use_ipaddr).get(timeout=SETUP_TIMEOUT_S)
    return (LOOPBACK if len(set(hosts)) == 1 and use_ipaddr is None else addr), port


def _check_master(master_addr: str | None, master_port: int | None) -> None:
    if (master_addr is None) != (master_port is None):
        raise SPMDError(f"master_addr={master_addr!r} and master_port={master_port!r}: give both, or neither "
                        "to let rank 0 pick a free port on its host")


def setup_torch_elastic_env(proc_mesh: Any, master_addr: str | None = None, master_port: int | None = None,
                            use_ipaddr: Any = None) -> None:
    """Set torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) in every proc of the
    mesh, so that actors spawned there may call `init_process_group()`. Without `master_addr`/`master_port`,
    rank 0 picks a free port on its host."""
    _check_master(master_addr, master_port)
    actors = _spawn(proc_mesh)
    if master_addr is None:
        master_addr, master_port = _master(actors, proc_mesh.hostnames, use_ipaddr)
    actors.setup_env.call(master_addr, master_port, uuid.uuid4().hex).get(timeout=SETUP_TIMEOUT_S)


async def setup_torch_elastic_env_async(proc_mesh: Any, master_addr: str | None = None,
                                        master_port: int | None = None, use_ipaddr: Any = None) -> None:
    """`setup_torch_elastic_env`, awaiting the mesh instead of blocking."""
    _check_master(master_addr, master_port)
    actors = _spawn(proc_mesh)
    if master_addr is None:
        master_addr, master_port = await _rank_zero(actors).get_host_port.call_one(use_ipaddr)
        if len(set(proc_mesh.hostnames)) == 1 and use_ipaddr is None:
            master_addr = LOOPBACK
    await actors.setup_env.call(master_addr, master_port, uuid.uuid4().hex)


def run_spmd(proc_mesh: Any, script: str, args: Sequence[str] = (), *, timeout: float | None = None,
             use_ipaddr: Any = None) -> None:
    """Run the torchrun-style `script` (or `"-m", module`) with `args` on every proc of the mesh, inside the
    worker processes: prints come back like any worker output; the first failing rank's exception (or a
    nonzero exit) is raised as `ActorError`. `timeout` bounds the script's run (None: no bound); the setup
    before it (rank 0's free port) has its own bound, SETUP_TIMEOUT_S."""
    actors = _spawn(proc_mesh)
    master_addr, master_port = _master(actors, proc_mesh.hostnames, use_ipaddr)
    argv = [script, *args]
    run_id = uuid.uuid4().hex
    futures = [one.main.call_one(master_addr, master_port, argv, run_id) for one in _points(actors)]
    _wait(futures, " ".join(argv), timeout)


def _wait(futures: list[Any], what: str, timeout: float | None) -> None:
    """Wait for every rank; raise the first failure as soon as it is known (the others may be blocked in a
    collective waiting for the failed rank)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(enumerate(futures))
    while pending:
        for r in [r for r, f in pending.items() if f.done()]:
            pending.pop(r).get()  # raises that rank's ActorError or SupervisionError
        if not pending:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"{what} did not finish within {timeout} s on rank(s) {sorted(pending)}; it keeps "
                               "running there, and those workers serve nothing else meanwhile: give run_spmd a "
                               "longer timeout, or stop the mesh")
        with contextlib.suppress(TimeoutError):  # a poll: the loop looks at every rank again
            next(iter(pending.values())).get(timeout=POLL_S if left is None else min(POLL_S, left))
