"""Workspace sync: how fast `sync_workspace` ships a tree of about 50 MB, against copies made on this machine.

Run: `.venv/bin/python benchmarks/workspace_sync.py [--files 500] [--file-kb 100] [--large 4] [--large-mb 1]`.
The tree (random bytes, fresh each run, in 10 directories) is synced to a local 2-process mesh: a first
sync (everything travels; it includes spawning the mesh's agents) and a second with nothing changed (the
controller hashes the tree, the host's writer compares manifests, nothing is sent). Baselines from the
same run: `shutil.copytree` of the tree to a fresh directory (no protocol, no processes: the memcpy-like
ceiling), `rsync -a` to a fresh directory and again unchanged (when rsync is on PATH), and the sha256 of
every file (what an unchanged sync costs the controller). The tree was just written, so every read comes
from the page cache. `measure(procs, root)` does all of it for any mesh, one that spans hosts too.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors import cpu_model, os_name

from monarch import config
from monarch.actor import ProcMesh, this_host
from monarch.cluster.workspace import MAX_BATCH, manifest, sync_workspace

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


def measure(procs: ProcMesh, root: Path, tree: Tree = Tree()) -> list[Row]:
    """Build `tree` in `root/tree`, time the baselines into `root`, then a first and an unchanged sync."""
    src = root / "tree"
    build(src, tree)
    n, size = tree.files + tree.large, tree.total_bytes
    copy = timed(lambda: shutil.copytree(src, root / "copytree"))
    shutil.rmtree(root / "copytree")
    hashing = timed(lambda: manifest(src))
    rows = [Row("shutil.copytree, fresh directory", n, size, copy), Row("sha256 of every file", n, 0, hashing)]
    fresh: tuple[tuple[str, float], ...] = ()
    unchanged: tuple[tuple[str, float], ...] = ()
    if shutil.which("rsync"):
        fresh = (("rsync", timed(lambda: rsync(src, root / "rsync"))),)
        unchanged = (("rsync", timed(lambda: rsync(src, root / "rsync"))),)
        shutil.rmtree(root / "rsync")
        rows += [Row("rsync -a, fresh directory", n, size, fresh[0][1], (("copytree", copy),)),
                 Row("rsync -a, unchanged", n, 0, unchanged[0][1])]
    first = sync_workspace(procs, src, timeout=TIMEOUT)
    second = sync_workspace(procs, src, timeout=TIMEOUT)
    assert (first.files_sent, first.bytes_sent) == (n * len(first.hosts), size * len(first.hosts)), first
    assert second.files_sent == 0, second
    hosts = f"{len(first.hosts)} host{'s' if len(first.hosts) > 1 else ''}"
    return rows + [
        Row(f"sync_workspace, first ({hosts})", first.files_sent, first.bytes_sent, first.seconds,
            (("copytree", copy), *fresh)),
        Row(f"sync_workspace, unchanged ({hosts})", second.files_total, 0, second.seconds,
            (("sha256", hashing), *unchanged))]


def print_table(rows: list[Row]) -> None:
    head = f"{'what':34} {'files':>6} {'MB':>6} {'seconds':>8} {'files/s':>9} {'MB/s':>6}  ratio to baseline"
    print(head)
    print("-" * (len(head) + 12))
    for r in rows:
        mb = r.nbytes / 1e6
        rate = f"{mb / r.seconds:6.0f}" if r.nbytes else f"{'-':>6}"
        ratio = ", ".join(f"{r.seconds / s:.2f}x {name}" for name, s in r.versus) or "-"
        print(f"{r.what:34} {r.files:>6} {mb:>6.1f} {r.seconds:>8.3f} {r.files / r.seconds:>9,.0f} {rate}  {ratio}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=500, help="small files (default 500)")
    p.add_argument("--file-kb", type=int, default=100, help="kB per small file (default 100)")
    p.add_argument("--large", type=int, default=4, help="large files (default 4)")
    p.add_argument("--large-mb", type=float, default=1, help="MB per large file (default 1)")
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
            rows = measure(procs, Path(tmp))
    print_table(rows)


if __name__ == "__main__":
    main()
