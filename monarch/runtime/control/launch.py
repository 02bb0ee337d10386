"""Starting and stopping the MPI job that hosts a proc mesh (controller side): `Lifecycle`, and its parts.

A `Launcher` says how a mesh's ranks start: `LocalLauncher` forks them on this host with the pip-installed
MPICH `mpiexec` (never a system one of another MPI); monarch/cluster has the ssh, Slurm and attach-mode
ones. This module also picks the control socket's bind and advertised addresses, hands the mesh token over
(`TokenHandover`), starts the job in its own process group with the worker environment, copies its output
to this console (telemetry/logs.py), and tears it down.
"""
from __future__ import annotations

import glob
import itertools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import IO, Protocol, TextIO

from monarch import config
from monarch.errors import SpawnError, SupervisionError
from monarch.runtime.control import codec
from monarch.runtime.control.bootstrap import token_file
from monarch.runtime.control.commands import LAUNCHER, Stop, describe_exit
from monarch.runtime.control.conn import Job, banner_free
from monarch.runtime.control.door import Door
from monarch.runtime.control.poller import Poller
from monarch.runtime.telemetry.events import RECORDER, output_lines
from monarch.runtime.telemetry.logs import OUTPUT
from monarch.runtime.telemetry.store import STORE
from monarch.shape import Shape

log = logging.getLogger("monarch.controller")
DRAIN_S = 5.0  # how long a stop waits for the last output of a job that exited (its pipes' ends, once read)

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

    def hand_over(self, token: str, directory: str, per_host: int) -> None:
        """Write the mesh token for each rank on its host (`token_script`), before the job starts; only
        launchers of other hosts are asked. Raises SpawnError when a host cannot be reached."""

    def release(self) -> None:
        """Give back what the launcher holds on its hosts (`HostMesh.shutdown`); proc meshes are stopped."""


HYDRA_TOPOLOGY = "/tmp/hydra_hwloc_xmlfile_*"  # each hydra proxy's topology file: removed by a clean end only


def topology_files() -> set[str]:
    """The hydra topology files on this host now (`spawn` notes those its job added: `ours`)."""
    return set(glob.glob(HYDRA_TOPOLOGY))


def ours(paths: set[str]) -> set[str]:
    """Those of `paths` that this user owns (the files a killed job may leave pile up in /tmp: only the few new
    ones are looked at, once per spawn)."""
    found = set()
    for path in paths:
        with suppress(OSError):
            if os.lstat(path).st_uid == os.geteuid():
                found.add(path)
    return found


def remove(paths: set[str]) -> None:
    for path in paths:
        with suppress(OSError):
            os.unlink(path)


LOOPBACK = "lo"  # the loopback interface's name on Linux


class LocalLauncher:
    """Every rank on this host, forked by mpiexec (the `this_host()` case)."""
    hosts = ["localhost"]
    local = True
    kill_signal = signal.SIGKILL

    def route(self) -> str:
        return "127.0.0.1"

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        return [find_mpiexec(), "-n", str(len(shape)), "-launcher", "fork", "-iface", LOOPBACK, *worker]

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """MPI's network modules (UCX, libfabric's tcp and sockets providers) listen on loopback only,
        unless the user's environment says otherwise."""
        return start(cmd, {"UCX_NET_DEVICES": LOOPBACK, "FI_TCP_IFACE": LOOPBACK, "FI_SOCKETS_IFACE": LOOPBACK, **env})

    def subset(self, hosts: list[str]) -> LocalLauncher:
        return self

    def hand_over(self, token: str, directory: str, per_host: int) -> None:
        raise AssertionError("the controller writes the token files of ranks on its own host")

    def release(self) -> None:
        return None


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
    return [sys.executable, "-m", "monarch.runtime.worker", "--controller", control,
            "--mesh-id", str(mesh_id), "--dims", dims, "--owner", str(os.getpid())]


REMOTE_TOKEN_ROOT = "/dev/shm"  # where token files go on other hosts: memory, never a disk


class TokenHandover:
    """How a mesh's token reaches its workers: one file per rank (0600, in a 0700 directory), named by
    `--token-dir` on the command line; each worker reads and deletes its own file at start (the last one
    also the directory), so the token is in no process's environment or command line and, after start-up,
    nowhere. On this host the controller writes the files (and `remove()` deletes what is left once the
    mesh settled, failed or stopped); on other hosts the launcher writes them before the job starts, over
    its own authenticated channel (ssh, an srun step, the attach-mode agent), never over MPI's."""

    def __init__(self, token: bytes, ranks: int, launcher: Launcher) -> None:
        self.local = launcher.local
        if self.local:
            self.dir = tempfile.mkdtemp(prefix="monarch-token-")
            for r in range(ranks):
                fd = os.open(token_file(self.dir, r), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(token.hex())
        else:
            self.dir = f"{REMOTE_TOKEN_ROOT}/monarch-token-{secrets.token_hex(8)}"
            launcher.hand_over(token.hex(), self.dir, ranks // len(launcher.hosts))

    @property
    def args(self) -> list[str]:
        """The worker's command-line arguments that say where its token is."""
        return ["--token-dir", self.dir]

    def remove(self) -> None:
        if self.local:
            shutil.rmtree(self.dir, ignore_errors=True)


def token_script(directory: str, ranks: str) -> str:
    """A POSIX sh script for another host: it reads the token (hex) from stdin and writes it to one 0600
    file per rank of `ranks` (a shell word list) in `directory` (0700, ours). No command line holds it."""
    return (f"umask 077 && mkdir -p {directory} && [ -O {directory} ] && chmod 700 {directory} && t=$(cat) && "
            f"for r in {ranks}; do printf %s \"$t\" > {directory}/rank-$r || exit 1; done")


# glibc: tensors up to 1 GiB come from the heap, and freed ones stay there for the next (instead of an mmap each,
# whose fresh pages all fault on first write: on a VM that costs more than the collective that fills them).
# (torch's THP_MEM_ALLOC_ENABLE=1 is not set: on this kind of VM its first huge-page faults made a 64 MiB
# all_reduce 10x slower for several calls, and at 4 ranks on 2 cores for good)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def worker_env(extra: dict[str, str] | None) -> dict[str, str]:
    """This process's environment plus `extra` (and MALLOC's defaults unless either sets them); workers import
    from the same paths as the controller."""
    env = {**MALLOC, **os.environ}
    env.update(extra or {})
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


class Peers(Protocol):
    """What starting and ending jobs needs of the controller: sending to a job's ranks, failing a job."""

    def fan_out(self, mesh: Job, shape: Shape, frame: bytes, what: str = "a message") -> None: ...

    def fail(self, mesh: Job, rank: int, pid: int, status: str) -> None: ...


class Lifecycle:
    """The controller's jobs from start to end: `spawn` starts one (its launcher's command, the token handed
    over, its output pipes watched) and waits until every worker connected; `stop` asks its workers to exit,
    kills what is left after the grace period and keeps why the job ended (`ended`); a job whose launcher
    exits on its own fails through `peers`."""

    def __init__(self, poller: Poller, door: Door, jobs: dict[int, Job], peers: Peers) -> None:
        self.poller, self.door, self.jobs, self.peers = poller, door, jobs, peers
        self.ended: dict[int, SupervisionError] = {}  # mesh id -> why it is gone
        self._ids = itertools.count(1)

    def spawn(self, name: str, shape: Shape, launcher: Launcher, env: dict[str, str] | None,
              bind: str | None = None) -> Job:
        mesh = Job(next(self._ids), name, shape, secrets.token_bytes(codec.TOKEN_BYTES), launcher.hosts)
        mesh.kill_signal = launcher.kill_signal
        bind, advertise = addresses(launcher, bind)
        control = f"{advertise}:{self.door.listen(bind).rsplit(':', 1)[1]}"
        handover = TokenHandover(mesh.token, len(shape), launcher)
        cmd = launcher.command(shape, worker_command(shape, control, mesh.id) + handover.args, advertise)
        log.debug("spawning mesh %r (id %d): %s", name, mesh.id, " ".join(cmd))
        self.jobs[mesh.id] = mesh
        before = topology_files() if launcher.local else set()
        workers = worker_env(env)
        mesh.max_frame = config.max_frame(workers)  # what they accept, also when spawn_procs(env=...) sets it
        try:
            mesh.proc = launcher.start(cmd, workers)
            assert mesh.proc.stdout is not None and mesh.proc.stderr is not None
            out, err = mesh.proc.stdout, mesh.proc.stderr
            self.poller.watch(out.fileno(), lambda: self._output(mesh, out, sys.stdout))
            self.poller.watch(err.fileno(), lambda: self._output(mesh, err, sys.stderr))
            timeout = config.spawn_timeout()
            self.poller.drive(mesh.settled.is_set, time.monotonic() + timeout)
        except SpawnError:
            del self.jobs[mesh.id]
            raise
        finally:
            handover.remove()  # every worker took its token file by now, or the spawn failed
            mesh.leftovers = ours(topology_files() - before) if launcher.local else set()
        if not mesh.settled.is_set() or mesh.failure is not None:
            why = mesh.failure or f"not every worker connected within {timeout} s (MONARCH_SPAWN_TIMEOUT)"
            self.stop(mesh, grace=0.5)
            tail = "\n".join(mesh.stderr_tail) or "(nothing)"
            raise SpawnError(f"spawning mesh {name!r} ({' '.join(cmd[:3])} ...) failed: {why}\n"
                             f"worker stderr, last lines:\n{tail}")
        return mesh

    def stop(self, mesh: Job, grace: float = 5.0) -> None:
        """Ask every worker to exit, wait for the job, and kill whatever is left of it."""
        if mesh.stopping:
            return
        mesh.stopping = True
        self.peers.fan_out(mesh, mesh.shape, codec.encode_frame([Stop()]))
        if mesh.proc is not None:
            terminate(mesh.proc, grace)
            self.poller.drive(lambda: OUTPUT.drained(mesh.id), time.monotonic() + DRAIN_S)  # its last lines
        OUTPUT.flush(mesh.id)
        remove(mesh.leftovers)  # the job is gone: what a killed launcher left goes too
        err = mesh.failure or SupervisionError(f"mesh {mesh.name!r} was stopped; spawn a new proc mesh")
        self.ended[mesh.id] = err
        mesh.fail_pending(err)
        for conn in mesh.conns:
            if conn is not None:
                self.door.close(conn)
        self.jobs.pop(mesh.id, None)

    def shutdown(self) -> None:
        for mesh in list(self.jobs.values()):
            self.stop(mesh, grace=2.0)

    def _output(self, mesh: Job, pipe: IO[bytes], stream: TextIO) -> None:
        data, name = pipe.read1(65536), "stderr" if stream is sys.stderr else "stdout"
        if not data:
            self.poller.unwatch(pipe.fileno())
            pipe.close()
            OUTPUT.end(mesh.id, name)
            if stream is sys.stderr:
                self._job_exited(mesh)
            return
        text = data.decode(errors="replace")
        mesh.note_output(name, text)
        if RECORDER.on:
            STORE.add(output_lines(mesh.shape, name, text), mesh.name)
        OUTPUT.write(mesh.id, name, banner_free(text))  # to this console as logging_option says (telemetry/logs.py)

    def _job_exited(self, mesh: Job) -> None:
        assert mesh.proc is not None
        try:
            code = mesh.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return
        if mesh.live:
            rank, why = mesh.blamed() or (LAUNCHER, describe_exit(code))
            self.peers.fail(mesh, rank, mesh.pids[rank] if rank >= 0 else mesh.proc.pid, why)
