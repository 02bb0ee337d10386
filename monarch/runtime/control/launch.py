"""Starting and stopping the MPI job that hosts a proc mesh (controller side).

A `Launcher` says how a mesh's ranks start: `LocalLauncher` forks them on this host with the pip-installed
MPICH `mpiexec` (never a system one of another MPI); monarch/cluster has the ssh, Slurm and attach-mode
ones. This module also picks the control socket's bind and advertised addresses, hands the mesh token over
(`TokenHandover`), starts the job in its own process group with the worker environment, and tears it down.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Protocol

from monarch import config
from monarch.errors import SpawnError
from monarch.runtime.control.bootstrap import token_file
from monarch.shape import Shape

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def find_mpiexec() -> str:
    """MONARCH_MPIEXEC, else the `mpiexec` next to this Python (the `mpich` wheel's)."""
    configured = config.mpiexec()
    candidates = [configured] if configured else [
        str(Path(sys.executable).parent / "mpiexec"), str(Path(sysconfig.get_path("scripts")) / "mpiexec")]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SpawnError(f"mpiexec not found at {' or '.join(candidates)}; install MPICH into this environment "
                     "(pip install mpich) or set MONARCH_MPIEXEC to the mpiexec of the MPI that mpi4py uses")


WILDCARDS = ("", "0.0.0.0", "::")


class Launcher(Protocol):
    """How the ranks of a mesh start: one rank per point of the shape, spread evenly over `hosts`
    (host i runs ranks i*k .. i*k+k-1), each running the `worker` command line."""
    hosts: list[str]
    local: bool  # every rank runs on this host (token files, the controller's pid mean something there)
    kill_signal: int  # what the job's process group gets when the mesh fails

    def route(self) -> str:
        """This host's address that the ranks' hosts reach (the advertised default)."""

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        """The command line that starts the job; `advertise` is the address workers connect back to."""

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start the job in its own process group, its stdout and stderr piped."""

    def subset(self, hosts: list[str]) -> Launcher:
        """The same way of starting ranks, on some of these hosts (a slice of a host mesh)."""


class LocalLauncher:
    """Every rank on this host, forked by mpiexec (the `this_host()` case)."""
    hosts = ["localhost"]
    local = True
    kill_signal = signal.SIGKILL

    def route(self) -> str:
        return "127.0.0.1"

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        return [find_mpiexec(), "-n", str(len(shape)), "-launcher", "fork", *worker]

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return start(cmd, env)

    def subset(self, hosts: list[str]) -> LocalLauncher:
        return self


def addresses(launcher: Launcher, bind: str | None) -> tuple[str, str]:
    """(bind, advertise): where the control socket listens and what workers are told to connect to.
    Bind: `bind` (spawn_procs' `host=`), else MONARCH_HOST, else the launcher's route (loopback for a local
    mesh, the local address of the route to the first remote host otherwise). Advertise: MONARCH_ADVERTISE,
    else the bind address, or the route when the bind address is a wildcard such as 0.0.0.0."""
    bind = bind or config.host() or launcher.route()
    return bind, config.advertise() or (launcher.route() if bind in WILDCARDS else bind)


def worker_command(shape: Shape, control: str, mesh_id: int) -> list[str]:
    """What each rank runs: the worker entry point, told the controller's address and the mesh's dims."""
    dims = ",".join(f"{k}={n}" for k, n in zip(shape.labels, shape.sizes, strict=True))
    return [sys.executable, "-m", "monarch.runtime.control.worker", "--controller", control,
            "--mesh-id", str(mesh_id), "--dims", dims, "--owner", str(os.getpid())]


class TokenHandover:
    """How a mesh's token reaches its workers. On this host: one file per rank (0600, in a fresh 0700
    directory), named by `--token-dir` on the command line; each worker reads and deletes its own file at
    start, and `remove()` deletes whatever is left once the mesh has settled, failed to spawn or stopped,
    so the token is in no process's environment (/proc/<pid>/environ) and, after start-up, on no disk.
    Ranks on other hosts cannot read this host's files: for a mesh with other hosts the token goes in
    the environment (config.WORKER_TOKEN) of mpiexec and the workers, until the cluster launch hands it over."""

    def __init__(self, token: bytes, ranks: int, local: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="monarch-token-") if local else ""
        self.env = {} if local else {config.WORKER_TOKEN: token.hex()}
        for r in range(ranks if local else 0):
            fd = os.open(token_file(self.dir, r), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token.hex())

    @property
    def args(self) -> list[str]:
        """The worker's command-line arguments that say where its token is."""
        return ["--token-dir", self.dir] if self.dir else []

    def remove(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def worker_env(extra: dict[str, str] | None, handover: TokenHandover) -> dict[str, str]:
    """This process's environment plus `extra` and what the token handover needs (nothing on this host);
    workers import from the same paths as the controller."""
    env = dict(os.environ)
    env.update(extra or {})
    env.pop(config.WORKER_TOKEN, None)
    env.update(handover.env)
    env["PYTHONUNBUFFERED"] = "1"
    ours = [os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")]
    path = [(extra or {}).get("PYTHONPATH", ""), _PACKAGE_ROOT, *ours, os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    return env


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise SpawnError(f"could not start {cmd[0]}: {e}") from e


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, sig)


def terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
    """Wait up to `grace` seconds for a clean exit, then SIGTERM, then SIGKILL the whole group."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            kill_group(proc, sig)
        try:
            code = proc.wait(timeout=grace)
            kill_group(proc, signal.SIGKILL)  # nothing of the job may outlive it
            return code
        except subprocess.TimeoutExpired:
            continue
    return proc.wait(timeout=grace)
