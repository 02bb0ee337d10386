"""Starting and stopping the MPI job that hosts a proc mesh (controller side).

Finds the pip-installed MPICH `mpiexec` (never a system one of another MPI), builds the command line,
hands the mesh token over (`TokenHandover`), starts the job in its own process group with the worker
environment, and tears the group down.
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


def all_local(hosts: list[str]) -> bool:
    """Whether every host of a mesh is this host (the `this_host()` case)."""
    return all(h == "localhost" for h in hosts)


def command(mpiexec: str, shape: Shape, hosts: list[str], control: str, mesh_id: int) -> list[str]:
    """The mpiexec command line; one rank per point of `shape`, spread evenly over `hosts`."""
    dims = ",".join(f"{k}={n}" for k, n in zip(shape.labels, shape.sizes, strict=True))
    cmd = [mpiexec, "-n", str(len(shape))]
    if hosts == ["localhost"]:
        cmd += ["-launcher", "fork"]
    else:
        cmd += ["-hosts", ",".join(hosts), "-ppn", str(len(shape) // len(hosts))]
    return cmd + [sys.executable, "-m", "monarch.runtime.control.worker", "--controller", control,
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
