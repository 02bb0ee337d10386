"""Workspace sync: how fast `sync_workspace` ships a tree of about 50 MB, against copies made on this machine.

Run: `.venv/bin/python benchmarks/workspace_sync.py [--files 500] [--file-kb 100] [--large 4] [--large-mb 1]
[--reps 3]`. Each round writes a fresh tree (random bytes, in 10 directories) and syncs it to a local 2-process
mesh: a first sync (everything travels; the first round's also spawns the mesh's agents) and a second with
nothing changed (the controller stats the tree and trusts the hashes of its last scan, the host's writer
compares manifests, nothing is sent). Baselines from the same rounds: `shutil.copytree` of the tree to a fresh
directory (no protocol, no processes: the memcpy-like ceiling), `rsync -a` to a fresh directory and again
unchanged (when rsync is on PATH), and the sha256 of every file. The tree was just written, so every read
comes from the page cache. `measure(procs, root)` does all of it for any mesh, one that spans hosts too;
given an ssh command and hosts (cluster.py), it also times `rsync -a -e SSH` of the tree to every host at
once, fresh and unchanged: the same work as the sync, done the way one would without monarch. Medians of
the rounds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors import cpu_model, os_name

from monarch import config
from monarch.actor import ProcMesh, this_host
from monarch.cluster.workspace import MAX_BATCH, SyncReport, manifest, sync_workspace

TIMEOUT = 600.0  # seconds one sync may take before the benchmark fails


@dataclass(frozen=True)
class Tree:
    files: int = 500
    file_bytes: int = 100_000
    large: int = 4
    large_bytes: int = 1_000_000

    @property
    def total_bytes(self) -> int:
        return self.files * self.file_bytes + self.large * self.large_bytes


@dataclass(frozen=True)
class Row:
    what: str
    files: int  # files copied (or checked, when nothing is sent)
    nbytes: int  # bytes copied
    seconds: float
    versus: tuple[tuple[str, float], ...] = ()  # (baseline, its seconds)


def build(root: Path, tree: Tree) -> None:
    """Write `tree` under `root` (emptied first) with fresh random bytes."""
    shutil.rmtree(root, ignore_errors=True)
    for i in range(tree.files + tree.large):
        path = root / f"d{i % 10}" / (f"f{i:04}.bin" if i < tree.files else f"large{i:04}.bin")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(tree.file_bytes if i < tree.files else tree.large_bytes))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rsync(src: Path, dst: Path) -> None:
    subprocess.run(["rsync", "-a", f"{src}/", f"{dst}/"], check=True, timeout=TIMEOUT)


def rsync_over_ssh(src: Path, dst: Path, ssh: str, hosts: list[str]) -> None:
    """`rsync -a -e SSH src/ HOST:dst-HOST/` to every host at once (dst on the hosts, one per host)."""
    runs = [subprocess.Popen(["rsync", "-a", "-e", ssh, f"{src}/", f"{host}:{dst}-{host}/"]) for host in hosts]
    for run in runs:
        if run.wait(timeout=TIMEOUT):
            raise RuntimeError(f"rsync over `{ssh}` failed with status {run.returncode}")


def measure(procs: ProcMesh, root: Path, tree: Tree = Tree(), ssh: str = "", hosts: list[str] | None = None,
            reps: int = 1) -> list[Row]:
    """Medians of `reps` rounds, each with a fresh tree in `root`: the baselines (over `ssh` to `hosts` too,
    when given: hosts that share this file system, as the test hosts do), then a first and an unchanged sync
    (the first round's first sync also spawns the mesh's agents)."""
    n, size = tree.files + tree.large, tree.total_bytes
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(reps):
        first, second = one_round(procs, root, root / f"tree{i}", tree, ssh, hosts or [], times)
        assert (first.files_sent, first.bytes_sent) == (n * len(first.hosts), size * len(first.hosts)), first
        assert second.files_sent == 0, second
    t = {what: statistics.median(seconds) for what, seconds in times.items()}
    rows = [Row("shutil.copytree, fresh directory", n, size, t["copytree"]),
            Row("sha256 of every file", n, 0, t["sha256"])]
    fresh = tuple((what, t[what]) for what in ("rsync", "rsync ssh") if what in t)
    unchanged = tuple((what, t[f"{what} unchanged"]) for what in ("rsync", "rsync ssh") if what in t)
    if "rsync" in t:
        rows += [Row("rsync -a, fresh directory", n, size, t["rsync"], (("copytree", t["copytree"]),)),
                 Row("rsync -a, unchanged", n, 0, t["rsync unchanged"])]
    if "rsync ssh" in t:
        k = len(hosts or [])
        rows += [Row(f"rsync -a -e ssh to {k} hosts, fresh", n * k, size * k, t["rsync ssh"]),
                 Row(f"rsync -a -e ssh to {k} hosts, unchanged", n * k, 0, t["rsync ssh unchanged"])]
    where = f"{len(first.hosts)} host{'s' if len(first.hosts) > 1 else ''}"
    how = "+".join(sorted(set(first.via.values())))
    return rows + [
        Row(f"sync_workspace, first ({where}, {how})", first.files_sent, first.bytes_sent, t["first"],
            (("copytree", t["copytree"]), *fresh)),
        Row(f"sync_workspace, unchanged ({where})", second.files_total, 0, t["unchanged"],
            (("sha256", t["sha256"]), *unchanged))]


def one_round(procs: ProcMesh, root: Path, src: Path, tree: Tree, ssh: str, hosts: list[str],
              times: dict[str, list[float]]) -> tuple[SyncReport, SyncReport]:
    """One round of `measure` on the fresh tree `src` (its copies on the hosts are new too: they are named
    after it); appends each timing to `times`."""
    build(src, tree)
    times["copytree"].append(timed(lambda: shutil.copytree(src, root / "copytree")))
    shutil.rmtree(root / "copytree")
    times["sha256"].append(timed(lambda: manifest(src)))
    if shutil.which("rsync"):
        for what in ("rsync", "rsync unchanged"):
            times[what].append(timed(lambda: rsync(src, root / "rsync")))
        shutil.rmtree(root / "rsync")
        for what in ("rsync ssh", "rsync ssh unchanged") if ssh and hosts else ():
            times[what].append(timed(lambda: rsync_over_ssh(src, root / "rsync", ssh, hosts)))
        for host in hosts:
            shutil.rmtree(f"{root / 'rsync'}-{host}", ignore_errors=True)
    first = sync_workspace(procs, src, timeout=TIMEOUT)
    second = sync_workspace(procs, src, timeout=TIMEOUT)
    times["first"].append(first.seconds)
    times["unchanged"].append(second.seconds)
    return first, second


def print_table(rows: list[Row]) -> None:
    head = f"{'what':40} {'files':>6} {'MB':>6} {'seconds':>8} {'files/s':>9} {'MB/s':>6}  ratio to baseline"
    print(head)
    print("-" * (len(head) + 12))
    for r in rows:
        mb = r.nbytes / 1e6
        rate = f"{mb / r.seconds:6.0f}" if r.nbytes else f"{'-':>6}"
        ratio = ", ".join(f"{r.seconds / s:.2f}x {name}" for name, s in r.versus) or "-"
        print(f"{r.what:40} {r.files:>6} {mb:>6.1f} {r.seconds:>8.3f} {r.files / r.seconds:>9,.0f} {rate}  {ratio}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=500, help="small files (default 500)")
    p.add_argument("--file-kb", type=int, default=100, help="kB per small file (default 100)")
    p.add_argument("--large", type=int, default=4, help="large files (default 4)")
    p.add_argument("--large-mb", type=float, default=1, help="MB per large file (default 1)")
    p.add_argument("--reps", type=int, default=3, help="rounds, each with a fresh tree; medians (default 3)")
    a = p.parse_args()
    tree = Tree(a.files, a.file_kb * 1000, a.large, int(a.large_mb * 1e6))
    print(f"monarch workspace_sync, {time.strftime('%Y-%m-%d')}: {a.files} files of {a.file_kb} kB and {a.large} "
          f"of {a.large_mb:g} MB ({tree.total_bytes / 1e6:.1f} MB), 2-process local mesh")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {os_name()}, load average {os.getloadavg()[0]:.2f}, "
          f"MONARCH_MAX_FRAME={config.max_frame()} (batches of {min(config.max_frame() // 2, MAX_BATCH) >> 20} MiB)")
    print()
    with tempfile.TemporaryDirectory(prefix="monarch-bench-") as tmp:
        env = {"MONARCH_WORKSPACE_DIR": str(Path(tmp) / "workspaces")}
        with this_host().spawn_procs(per_host={"gpus": 2}, name="bench-workspace", env=env) as procs:
            rows = measure(procs, Path(tmp), reps=a.reps)
    print_table(rows)


if __name__ == "__main__":
    main()
