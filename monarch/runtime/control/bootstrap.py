"""Worker start-up under mpiexec: find the rank, fork a monitor, join MPI, connect back, authenticate.

The process mpiexec starts forks. The child becomes the worker (it joins MPI and serves the control
plane); the parent stays a small monitor that prefixes the child's output with its mesh coordinates and,
if the child dies abnormally, reports the exit status to the controller before exiting with it. The mesh
token comes from this rank's token file (`--token-dir`, read and deleted at once), never from the
environment or the command line, on every host (launch.TokenHandover). The Hello says how many GPUs the
worker sees, and `mesh_device` is the one rule by which the controller and each worker agree on the mesh's
device type.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import socket
import sys
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from monarch import config
from monarch.runtime.control.codec import ROLE_MONITOR, ROLE_WORKER, Header, encode_frame
from monarch.runtime.control.commands import Hello, ProcExit
from monarch.shape import Shape

_RANK_ENVS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")  # declared in config.EXTERNAL
OWNER_CHECK_S = 1.0  # how often a monitor looks for its controller while the worker is quiet


@dataclass(frozen=True)
class Launch:
    """What the controller told this process on its command line (and the token, from its file)."""
    host: str
    port: int
    mesh_id: int
    shape: Shape
    token: bytes
    rank: int
    owner: int = 0  # the controller's pid: when it is gone, the worker is killed

    @property
    def local(self) -> bool:
        """Whether the controller runs on this host (so that its pid means something here)."""
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def header(self, role: int) -> bytes:
        return Header(self.mesh_id, role, self.rank, self.token).encode()

    def connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@dataclass(frozen=True)
class Boot:
    """A started worker: its authenticated control socket, its rank and its mesh's id."""
    sock: socket.socket
    rank: int
    mesh_id: int = 0


def parse(argv: list[str]) -> Launch:
    p = argparse.ArgumentParser(prog="python -m monarch.runtime.worker")
    p.add_argument("--controller", required=True, help="host:port of the controller's control socket")
    p.add_argument("--mesh-id", type=int, required=True)
    p.add_argument("--dims", required=True, help="mesh dims, e.g. dp=2,tp=2")
    p.add_argument("--owner", type=int, default=0, help="pid of the controller; the worker dies with it")
    p.add_argument("--token-dir", required=True, help="directory of the mesh's token files, one per rank")
    a = p.parse_args(argv)
    host, port = a.controller.rsplit(":", 1)
    dims = [d.split("=") for d in a.dims.split(",") if d]
    shape = Shape.row_major(tuple(k for k, _ in dims), tuple(int(v) for _, v in dims))
    rank = next((int(v) for k in _RANK_ENVS if (v := config.external(k))), 0)
    token = take_token(token_file(a.token_dir, rank))
    return Launch(host, int(port), a.mesh_id, shape, token, rank, a.owner)


def token_file(directory: str, rank: int) -> str:
    """Where rank `rank` finds the mesh token (written by the controller, see launch.TokenHandover)."""
    return os.path.join(directory, f"rank-{rank}")


def take_token(path: str) -> bytes:
    """Read this rank's token file and delete it, so that the token is nowhere once we started; the last
    rank of a host to start also removes the directory."""
    try:
        with open(path) as f:
            token = bytes.fromhex(f.read())
        os.unlink(path)
        with suppress(OSError):  # other ranks' files are still there
            os.rmdir(os.path.dirname(path))
    except (OSError, ValueError) as e:
        raise SystemExit(f"monarch worker: cannot take the mesh token from {path}: {e} (it is written by the "
                         "controller for one start of this rank, and deleted by it)") from None
    return token


def visible_gpus() -> int:
    """How many GPUs this process may use: those CUDA_VISIBLE_DEVICES names, else the host's NVIDIA device files
    (no CUDA call, so no GPU context is made)."""
    named = config.cuda_visible_devices()
    if named is not None:
        return 0 if named[:1] == ["-1"] else len(named)
    with suppress(OSError):
        return len([n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit()])
    return 0


def mesh_device(wanted: str, gpus: int, local_ranks: int) -> str:
    """The device type of a rank's tensors, from MONARCH_DEVICE (`wanted`), the GPUs it sees and how many ranks
    of its mesh share its host: auto means cuda when each of those ranks can have a GPU of its own."""
    if wanted == "auto":
        return "cuda" if gpus >= local_ranks > 0 else "cpu"
    return wanted


def start(argv: list[str]) -> Boot:
    """Returns only in the worker child; the monitor parent exits with the child's status."""
    launch = parse(argv)
    _close_inherited_listeners()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child:
        _close(out_w, err_w)
        prefix = f"[{launch.shape.point(launch.rank).label()}] ".encode()
        os._exit(_monitor(launch, child, {out_r: 1, err_r: 2}, prefix))
    _close(out_r, err_r)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    _close(out_w, err_w)
    _die_with_parent(parent)
    from mpi4py import MPI  # joins the MPI job: rank and size come from the process manager
    world = MPI.COMM_WORLD
    assert world.Get_rank() == launch.rank, (world.Get_rank(), launch.rank)
    assert world.Get_size() == len(launch.shape), (world.Get_size(), launch.shape)
    world.Barrier()  # every rank of the job, so of this host, attached MPICH's shared memory
    _unlink_shared_memory()
    sock = _connect_back(launch)
    hello = Hello(os.getpid(), socket.gethostname(), os.getppid(), visible_gpus())
    sock.sendall(launch.header(ROLE_WORKER) + encode_frame([hello]))
    return Boot(sock, launch.rank, launch.mesh_id)


def leave(code: int) -> None:
    """End a worker whose controller has all it will get: finalize MPI (the job ends cleanly, with no
    launcher banner), flush the output, and exit without tearing the interpreter down (with torch
    loaded that took seconds, and every stop of a mesh waited for it)."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _close_inherited_listeners() -> None:
    """Close the listening sockets this process inherited (Hydra's control port, open on every interface):
    a worker serves nothing on them, and holding them would keep the port open after mpiexec is gone."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc
        return
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket, or already closed (the fd of the listdir above)
            continue
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.close()
        else:
            sock.detach()


def _unlink_shared_memory() -> None:
    """Remove the names of the shared-memory segments MPICH mapped (`/dev/shm/mpich_shm_*`): every rank of
    this host holds its mapping, and without a name no end of the job (kill -9 included) leaves them behind."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.split(maxsplit=5)[5].rstrip("\n") for line in f if " /dev/shm/mpich_shm_" in line}
    except OSError:  # no /proc: MPICH removes them at a normal end
        return
    for name in names:
        with suppress(OSError):  # another rank of this host removed it first, or the mapping is "(deleted)"
            os.unlink(name)


def _connect_back(launch: Launch) -> socket.socket:
    try:
        return launch.connect(timeout=30)
    except OSError as e:
        raise SystemExit(
            f"monarch worker rank {launch.rank} on host {socket.gethostname()}: cannot connect to the controller at "
            f"{launch.host}:{launch.port}: {e}. That is the address the controller advertises: set MONARCH_ADVERTISE "
            "on the controller to an address of its host that this host reaches (and MONARCH_HOST or spawn_procs("
            "host=...) to one it binds), and check that no firewall blocks the port") from None


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _die_with_parent(parent: int) -> None:
    with suppress(OSError, AttributeError):  # not Linux: the control socket's EOF still ends the worker
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _monitor(launch: Launch, child: int, pipes: dict[int, int], prefix: bytes) -> int:
    """Forward the child's output line by line with `prefix`; report an abnormal exit. If the
    controller dies (even by SIGKILL) the child is killed at once, not after its queued work."""
    partial = {fd: b"" for fd in pipes}
    tail: deque[str] = deque(maxlen=20)
    check = time.monotonic() + OWNER_CHECK_S  # on a clock: a worker that writes all the time is no excuse
    while partial:
        ready = select.select(list(partial), [], [], max(0.0, check - time.monotonic()))[0]
        if time.monotonic() >= check:
            check = time.monotonic() + OWNER_CHECK_S
            if launch.local and not _alive(launch.owner):
                with suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        for fd in ready:
            data = os.read(fd, 65536)
            lines = (partial[fd] + data).split(b"\n")
            if not data:
                lines, rest = [ln for ln in lines if ln], None
            else:
                rest = lines.pop()
            for ln in lines:
                _write(pipes[fd], prefix + ln + b"\n")
                if pipes[fd] == 2:
                    tail.append(ln.decode(errors="replace"))
            if rest is None:
                del partial[fd]
            else:
                partial[fd] = rest
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        _report(launch, ProcExit(launch.rank, child, status, "\n".join(tail)))
    return code if code >= 0 else 128 - code


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (dead, not yet reaped by its parent) does not; kill(pid, 0)
    alone would say it does."""
    if pid <= 0:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X", "x")


def _write(fd: int, data: bytes) -> None:
    with suppress(OSError):  # mpiexec's end of the pipe is gone: output has nowhere to go
        os.write(fd, data)


def _report(launch: Launch, msg: ProcExit) -> None:
    try:
        with launch.connect(timeout=5) as sock:
            sock.sendall(launch.header(ROLE_MONITOR) + encode_frame([msg]))
    except OSError as e:
        sys.stderr.write(f"monarch monitor: could not report rank {launch.rank}'s exit: {e}\n")
