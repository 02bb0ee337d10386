"""Every environment flag monarch reads, declared once and typed.

Read a flag through its typed accessor (`config.debug()`), never `os.environ` elsewhere; variables of
other systems (MPI, Slurm, XDG, OpenTelemetry) are declared in EXTERNAL and read with `external(name)`.
The tables below are the documentation (`python -m monarch.config` prints them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Callable, Mapping, TypeVar

ATTACH_SECRET = "MONARCH_ATTACH_SECRET"  # attach mode's shared secret (cluster/agent.py keeps it from children)


@dataclass(frozen=True)
class Flag:
    name: str
    default: str
    help: str

    def raw(self, env: Mapping[str, str] | None = None) -> str:
        return (os.environ if env is None else env).get(self.name, self.default)


FLAGS: dict[str, Flag] = {f.name: f for f in [
    Flag("MONARCH_DEBUG", "0", "1 logs control-plane events (spawns, connections, failures) to stderr"),
    Flag("MONARCH_HOST", "", "address the controller's control socket binds to (default: loopback for a mesh on "
         "this host; for other hosts, this host's address on the route to the first of them)"),
    Flag("MONARCH_ADVERTISE", "", "address workers are told to connect back to (default: the bound address, or "
         "the route's address when MONARCH_HOST is a wildcard such as 0.0.0.0)"),
    Flag("MONARCH_SSH", "ssh", "command Hydra starts processes on other hosts with, e.g. `ssh -F ~/cluster.conf`"),
    Flag("MONARCH_IFACE", "", "network interface MPICH's Hydra uses (default: the one of the advertised address)"),
    Flag("MONARCH_MPIEXEC", "", "path of the mpiexec to launch workers with (default: the venv's MPICH)"),
    Flag("MONARCH_SPAWN_TIMEOUT", "60", "seconds to wait for every worker to connect back"),
    Flag("MONARCH_MAX_FRAME", str(1 << 30), "largest control-plane frame in bytes"),
    Flag("MONARCH_DEATH_GRACE", "0.3", "seconds to wait for a dead worker's exit status before failing"),
    Flag("MONARCH_SPIN_US", "50", "microseconds to busy-poll for the next message before sleeping (0: never)"),
    Flag("MONARCH_STRICT", "0", "1 raises UnsupportedOpError for an op with no sharding rule instead of "
         "running it replicated"),
    Flag("MONARCH_WORKER_THREADS", "0", "torch intra-op threads per worker (0: the host's cores over its workers)"),
    Flag("MONARCH_BUCKET_MB", "25", "compiled steps: gradients are reduced as DDP does, all_reduces started as "
         "soon as their inputs are written and bucketed up to this many MiB, the first bucket up to 1 MiB "
         "(0: each gradient is reduced where the optimizer first reads it, blocking)"),
    Flag("MONARCH_SHARD_UPDATE", "auto", "compiled steps: weight-update sharding (ZeRO-1/2) of parameters "
         "replicated over a data-parallel mesh dim: their gradients are reduce-scattered, each rank updates its "
         "slice of them and of the optimizer state, the updated slices are all-gathered. auto: parameters of at "
         "least MONARCH_SHARD_UPDATE_KB; on: every parameter that can be split; off: none"),
    Flag("MONARCH_SHARD_UPDATE_KB", "256", "smallest parameter (KiB) whose update MONARCH_SHARD_UPDATE=auto shards"),
    Flag("MONARCH_DEVICE", "auto", "device type of a worker's tensors (spawn_procs(device=) sets it for its workers): "
         "auto (cuda where every rank of a host has a GPU of its own), cpu or cuda"),
    Flag("MONARCH_SHARE_GPUS", "0", "1 lets a CUDA mesh put more processes on a host than it has GPUs (they take "
         "the GPUs in turn; collectives then go through MPI, as NCCL refuses two ranks on one GPU)"),
    Flag("MONARCH_TRANSPORT", "auto", "data plane of tensor collectives: auto (shared memory for a group whose "
         "ranks share a host, MPI across hosts), mpi, or shm (every group must be on one host)"),
    Flag("MONARCH_COLLECTIVES", "auto", "what runs tensor collectives: auto (torch.distributed's NCCL for CUDA "
         "tensors, MONARCH_TRANSPORT's choice for CPU tensors, and for CUDA tensors through host memory where NCCL "
         "cannot run: no NCCL, GPUs shared), mpi (MONARCH_TRANSPORT's choice; CUDA tensors through host memory), "
         "or torch (torch.distributed for every collective: gloo for CPU tensors, NCCL for CUDA tensors)"),
    Flag("MONARCH_TELEMETRY", "1", "0 turns off recording of telemetry events (messages, programs, failures, ...)"),
    Flag("MONARCH_PROFILE", "0", "1 records the time of every tensor instruction on the workers (ops table)"),
    Flag("MONARCH_TELEMETRY_DB", "", "a file for the telemetry database (default: in memory)"),
    Flag("MONARCH_ADMIN", "1", "0: the controller does not answer `monarch query` / `monarch top`"),
    Flag("MONARCH_FLUSH_OPS", "20000", "recorded ops after which the pending graph is shipped without a sync"),
    Flag("MONARCH_HEARTBEAT_TIMEOUT", "5", "seconds a worker may be silent (no heartbeat) before its mesh fails "
         "(0: never)"),
    Flag("MONARCH_PRELOAD_TORCH", "off", "on: each worker imports torch on a background thread once it connected, "
         "so that its first tensor operation does not wait for all of it; off: on the first tensor operation; auto: "
         "on where the host has two cores for each of its workers (the import takes seconds of CPU). While a worker "
         "imports torch its silence is excused (up to 120 s), so a host lost meanwhile is found late: off by default"),
    Flag("MONARCH_TELEMETRY_RETAIN", "100000", "telemetry rows kept per table on the controller; the oldest "
         "are dropped beyond it (0: keep all)"),
    Flag("MONARCH_QUERY_TIMEOUT", "30", "seconds a telemetry SQL query may run (procs.sql, monarch.sql, `monarch "
         "query`) before it is cancelled with QueryTimeout; an admin client may ask for less (0: no limit)"),
    Flag("MONARCH_MAX_LOCAL_PROCS", "", "most worker processes of one local mesh (default: 16 per core)"),
    Flag(ATTACH_SECRET, "", "attach mode: the secret shared by the controller and the agents (`python -m monarch "
         "worker`); agents keep it out of what they start"),
    Flag("MONARCH_ATTACH_SECRET_FILE", "", "attach mode: a file holding that secret, read when "
         "MONARCH_ATTACH_SECRET is unset (Kubernetes pods mount it from a Secret)"),
    Flag("MONARCH_ATTACH_BYTES", str(32 << 20), "collectives within a host whose largest tensor has this many bytes "
         "or more read each other's memory by cross-memory attach (one copy); smaller ones go through a shared "
         "segment, whose two copies stay in cache"),
    Flag("MONARCH_RDMA_BACKEND", "auto", "one-sided transfers (monarch.rdma, to_mesh): auto picks ibverbs where both "
         "ends have an RDMA device, shm (cross-memory attach) between processes of one host, mpi (MPI RMA windows) "
         "between workers of two hosts where UCX has an RDMA transport, else tcp; or force one"),
    Flag("MONARCH_RDMA_ALLOW_TCP_FALLBACK", "1", "0: a one-sided transfer that only TCP can carry raises "
         "TransportError instead of warning once and using TCP"),
    Flag("MONARCH_RDMA_TIMEOUT", "30", "seconds a one-sided transfer that to_mesh runs may take before it fails"),
    Flag("MONARCH_RDMA_DEVICE", "", "the RDMA device (and port) verbs transfers use, e.g. mlx5_0 or mlx5_0:2 "
         "(default: the first device with an active port)"),
    Flag("MONARCH_WORKSPACE_DIR", "~/.cache/monarch/workspaces", "where workers keep the copies sync_workspace "
         "makes: <dir>/<hostname>/<name>-<hash of the source path>"),
    Flag("MONARCH_WORKSPACE_STREAM", "1", "1: sync_workspace streams the files each host lacks over a TCP connection "
         "to that host's writer (control-plane frames where it cannot connect); 0: always in control-plane frames"),
]}


EXTERNAL: dict[str, Flag] = {f.name: f for f in [
    Flag("PMI_RANK", "", "this worker's rank, from MPICH's Hydra (PMI)"),
    Flag("PMIX_RANK", "", "this worker's rank, from a PMIx process manager"),
    Flag("OMPI_COMM_WORLD_RANK", "", "this worker's rank, from Open MPI's mpirun"),
    Flag("SLURM_PROCID", "", "this worker's rank, from Slurm's srun"),
    Flag("SLURM_JOB_ID", "", "the Slurm allocation this process runs in (salloc, sbatch)"),
    Flag("SLURM_JOB_NODELIST", "", "the nodes of that allocation, e.g. node[1-4]"),
    Flag("UCX_TLS", "", "the transports UCX (under MPICH) may use; the mpi one-sided backend is picked by auto only "
         "where they include an RDMA one (rc, dc, ud)"),
    Flag("UCX_NET_DEVICES", "", "the devices UCX may use (local meshes set lo); likewise read for that choice"),
    Flag("MPI_LOCALNRANKS", "1", "ranks of the MPI job on this host (MPICH's Hydra), to share its cores"),
    Flag("MPI_LOCALRANKID", "0", "this worker's index among the ranks of its host (MPICH's Hydra): the GPU it binds"),
    Flag("CUDA_VISIBLE_DEVICES", "", "the GPUs a process may use, as CUDA reads it (unset: every GPU of the host)"),
    Flag("XDG_RUNTIME_DIR", "", "where the admin endpoint announces itself (default: the temp dir)"),
    Flag("PYTHONBREAKPOINT", "", "on workers: 0 disables breakpoint(); unset (or pdb.set_trace) pauses the rank in "
         "a pdb that `monarch debug` attaches to; another debugger is called as Python does"),
    Flag("OTEL_EXPORTER_OTLP_ENDPOINT", "", "set: telemetry is exported there with OpenTelemetry (otel.py)"),
]}


def external(name: str) -> str:
    """A variable that another system defines and sets (MPI, Slurm, XDG, OpenTelemetry), read as it is;
    it must be declared in EXTERNAL. Monarch's own flags have typed accessors below."""
    return EXTERNAL[name].raw()


T = TypeVar("T")


def _parse(name: str, cast: Callable[[str], T], env: Mapping[str, str] | None = None) -> T:
    flag = FLAGS[name]
    try:
        return cast(flag.raw(env))
    except ValueError as e:
        raise ValueError(f"{name}={flag.raw(env)!r} is not valid ({flag.help}): {e}") from None


def _truthy(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


def _bool(name: str) -> bool:
    return _parse(name, _truthy)


def _int(name: str) -> int:
    return _parse(name, int)


def _float(name: str) -> float:
    return _parse(name, float)


def _str(name: str) -> str:
    return FLAGS[name].raw()


@cache
def _choice(*allowed: str) -> Callable[[str], str]:
    """A cast that accepts one of `allowed` (case-insensitive); one per set of choices."""
    def cast(s: str) -> str:
        if s.strip().lower() not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return s.strip().lower()
    return cast


def debug() -> bool:
    return _bool("MONARCH_DEBUG")


def host() -> str:
    return _str("MONARCH_HOST")


def advertise() -> str:
    return _str("MONARCH_ADVERTISE")


def ssh() -> str:
    return _str("MONARCH_SSH")


def iface() -> str:
    return _str("MONARCH_IFACE")


def mpiexec() -> str:
    return _str("MONARCH_MPIEXEC")


def spawn_timeout() -> float:
    return _float("MONARCH_SPAWN_TIMEOUT")


def max_frame(env: Mapping[str, str] | None = None) -> int:
    """The flag here, or in `env` (a mesh's worker environment: the largest frame its workers accept)."""
    return _parse("MONARCH_MAX_FRAME", int, env)


def death_grace() -> float:
    return _float("MONARCH_DEATH_GRACE")


def spin_seconds() -> float:
    return _float("MONARCH_SPIN_US") * 1e-6


def strict() -> bool:
    return _bool("MONARCH_STRICT")


def worker_threads() -> int:
    return _int("MONARCH_WORKER_THREADS")


def bucket_bytes() -> int:
    """MONARCH_BUCKET_MB in bytes."""
    return int(_float("MONARCH_BUCKET_MB") * (1 << 20))


def shard_update() -> str:
    """MONARCH_SHARD_UPDATE: auto, on or off."""
    return _parse("MONARCH_SHARD_UPDATE", _choice("auto", "on", "off"))


def shard_update_bytes() -> int:
    """The smallest parameter, in bytes, whose update is sharded under MONARCH_SHARD_UPDATE=auto."""
    return int(_float("MONARCH_SHARD_UPDATE_KB") * 1024)


TRANSPORTS = ("auto", "mpi", "shm")


def transport() -> str:
    """MONARCH_TRANSPORT, one of TRANSPORTS."""
    return _parse("MONARCH_TRANSPORT", _choice(*TRANSPORTS))


COLLECTIVES = ("auto", "mpi", "torch")


def collectives() -> str:
    """MONARCH_COLLECTIVES, one of COLLECTIVES."""
    return _parse("MONARCH_COLLECTIVES", _choice(*COLLECTIVES))


def telemetry() -> bool:
    return _bool("MONARCH_TELEMETRY")


def profile() -> bool:
    return _bool("MONARCH_PROFILE")


def telemetry_db() -> str:
    return _str("MONARCH_TELEMETRY_DB")


def admin() -> bool:
    return _bool("MONARCH_ADMIN")


def flush_ops() -> int:
    return _int("MONARCH_FLUSH_OPS")


def heartbeat_timeout() -> float:
    return _float("MONARCH_HEARTBEAT_TIMEOUT")


def preload_torch() -> str:
    """MONARCH_PRELOAD_TORCH: auto, on or off."""
    return _parse("MONARCH_PRELOAD_TORCH", _choice("auto", "on", "off"))


def telemetry_retain() -> int:
    return _int("MONARCH_TELEMETRY_RETAIN")


def query_timeout() -> float:
    return _float("MONARCH_QUERY_TIMEOUT")


def max_local_procs() -> int:
    """MONARCH_MAX_LOCAL_PROCS, else 16 worker processes per core of this host."""
    return _int("MONARCH_MAX_LOCAL_PROCS") if _str("MONARCH_MAX_LOCAL_PROCS").strip() else 16 * (os.cpu_count() or 1)


def attach_bytes() -> int:
    return _int("MONARCH_ATTACH_BYTES")


def device() -> str:
    """MONARCH_DEVICE: auto, cpu or cuda."""
    return _parse("MONARCH_DEVICE", _choice("auto", "cpu", "cuda"))


def share_gpus() -> bool:
    return _bool("MONARCH_SHARE_GPUS")


def cuda_visible_devices() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names (None when it is unset: every GPU of the host)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if raw is None else [d.strip() for d in raw.split(",") if d.strip()]


def rdma_backend() -> str:
    return _parse("MONARCH_RDMA_BACKEND", _choice("auto", "ibverbs", "shm", "mpi", "tcp"))


def rdma_allow_tcp_fallback() -> bool:
    return _bool("MONARCH_RDMA_ALLOW_TCP_FALLBACK")


def rdma_timeout() -> float:
    return _float("MONARCH_RDMA_TIMEOUT")


def _device_port(s: str) -> tuple[str, int]:
    name, _, port = s.strip().partition(":")
    if port and (not port.isdigit() or int(port) < 1):
        raise ValueError(f"the port {port!r} is not a number from 1")
    return name, int(port or 0)


def rdma_device() -> tuple[str, int]:
    """MONARCH_RDMA_DEVICE as (device name, port): ("", 0) picks the first active port; port 0, any of the
    device's."""
    return _parse("MONARCH_RDMA_DEVICE", _device_port)


def workspace_dir() -> str:
    """MONARCH_WORKSPACE_DIR with `~` expanded (read on the workers, which keep the copies)."""
    return os.path.expanduser(_str("MONARCH_WORKSPACE_DIR"))


def workspace_stream() -> bool:
    return _bool("MONARCH_WORKSPACE_STREAM")


def attach_secret() -> str:
    return _str(ATTACH_SECRET)


def attach_secret_file() -> str:
    return _str("MONARCH_ATTACH_SECRET_FILE")


def _table(flags: dict[str, Flag], width: int) -> str:
    return "\n".join(f"{f.name:{width}} default {f.default!r:14} {f.help}" for f in flags.values())


if __name__ == "__main__":
    width = max(map(len, [*FLAGS, *EXTERNAL]))
    print(_table(FLAGS, width), "\nread as other systems set them:", _table(EXTERNAL, width), sep="\n")
