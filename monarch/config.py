"""Every environment flag monarch reads, declared once and typed.

Read a flag through its accessor (`config.debug()`), never `os.environ` elsewhere; the table below is
the documentation (`python -m monarch.config` prints it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Flag:
    name: str
    default: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)


FLAGS: dict[str, Flag] = {f.name: f for f in [
    Flag("MONARCH_DEBUG", "0", "1 logs control-plane events (spawns, connections, failures) to stderr"),
    Flag("MONARCH_HOST", "127.0.0.1", "address the controller's control socket binds to"),
    Flag("MONARCH_MPIEXEC", "", "path of the mpiexec to launch workers with (default: the venv's MPICH)"),
    Flag("MONARCH_SPAWN_TIMEOUT", "60", "seconds to wait for every worker to connect back"),
    Flag("MONARCH_MAX_FRAME", str(1 << 30), "largest control-plane frame in bytes"),
    Flag("MONARCH_DEATH_GRACE", "0.3", "seconds to wait for a dead worker's exit status before failing"),
    Flag("MONARCH_SPIN_US", "50", "microseconds to busy-poll for the next message before sleeping (0: never)"),
    Flag("MONARCH_STRICT", "0", "1 raises UnsupportedOpError for an op with no sharding rule instead of "
         "running it replicated"),
    Flag("MONARCH_WORKER_THREADS", "0", "torch intra-op threads per worker (0: the host's cores over its workers)"),
    Flag("MONARCH_BUCKET_BYTES", str(4 << 20), "compiled steps: all_reduces start early and share buckets up to "
         "this size (0: run them where they are, blocking)"),
    Flag("MONARCH_TELEMETRY", "1", "0 turns off recording of telemetry events (messages, programs, failures, ...)"),
    Flag("MONARCH_PROFILE", "0", "1 records the time of every tensor instruction on the workers (ops table)"),
    Flag("MONARCH_TELEMETRY_DB", "", "a file for the telemetry database (default: in memory)"),
    Flag("MONARCH_ADMIN", "1", "0: the controller does not answer `monarch query` / `monarch top`"),
    Flag("MONARCH_FLUSH_OPS", "20000", "recorded ops after which the pending graph is shipped without a sync"),
    Flag("MONARCH_HEARTBEAT_TIMEOUT", "5", "seconds a worker may be silent (no heartbeat) before its mesh fails "
         "(0: never)"),
    Flag("MONARCH_TELEMETRY_RETAIN", "100000", "telemetry rows kept per table on the controller; the oldest "
         "are dropped beyond it (0: keep all)"),
    Flag("MONARCH_MAX_LOCAL_PROCS", "", "most worker processes of one local mesh (default: 16 per core)"),
]}


def _get(name: str, cast: Callable[[str], object]):
    flag = FLAGS[name]
    try:
        return cast(flag.raw())
    except ValueError as e:
        raise ValueError(f"{name}={flag.raw()!r} is not valid ({flag.help}): {e}") from None


def _bool(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


def debug() -> bool:
    return bool(_get("MONARCH_DEBUG", _bool))


def host() -> str:
    return str(_get("MONARCH_HOST", str))


def mpiexec() -> str:
    return str(_get("MONARCH_MPIEXEC", str))


def spawn_timeout() -> float:
    return float(_get("MONARCH_SPAWN_TIMEOUT", float))  # type: ignore[arg-type]


def max_frame() -> int:
    return int(_get("MONARCH_MAX_FRAME", int))  # type: ignore[arg-type]


def death_grace() -> float:
    return float(_get("MONARCH_DEATH_GRACE", float))  # type: ignore[arg-type]


def spin_seconds() -> float:
    return float(_get("MONARCH_SPIN_US", float)) * 1e-6  # type: ignore[arg-type]


def strict() -> bool:
    return bool(_get("MONARCH_STRICT", _bool))


def worker_threads() -> int:
    return int(_get("MONARCH_WORKER_THREADS", int))  # type: ignore[arg-type]


def bucket_bytes() -> int:
    return int(_get("MONARCH_BUCKET_BYTES", int))  # type: ignore[arg-type]


def telemetry() -> bool:
    return bool(_get("MONARCH_TELEMETRY", _bool))


def profile() -> bool:
    return bool(_get("MONARCH_PROFILE", _bool))


def telemetry_db() -> str:
    return str(_get("MONARCH_TELEMETRY_DB", str))


def admin() -> bool:
    return bool(_get("MONARCH_ADMIN", _bool))


def flush_ops() -> int:
    return int(_get("MONARCH_FLUSH_OPS", int))  # type: ignore[arg-type]


def heartbeat_timeout() -> float:
    return float(_get("MONARCH_HEARTBEAT_TIMEOUT", float))  # type: ignore[arg-type]


def telemetry_retain() -> int:
    return int(_get("MONARCH_TELEMETRY_RETAIN", int))  # type: ignore[arg-type]


def max_local_procs() -> int:
    """MONARCH_MAX_LOCAL_PROCS, else 16 worker processes per core of this host."""
    raw = FLAGS["MONARCH_MAX_LOCAL_PROCS"].raw().strip()
    return int(_get("MONARCH_MAX_LOCAL_PROCS", int)) if raw else 16 * (os.cpu_count() or 1)  # type: ignore[arg-type]


if __name__ == "__main__":
    for f in FLAGS.values():
        print(f"{f.name:24} default {f.default!r:14} {f.help}")
