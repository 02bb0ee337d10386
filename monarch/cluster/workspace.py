"""Workspace sync: copy a directory of the user's code to every host of a proc mesh, once per content change.

The controller hashes the tree (again only the files whose size or timestamps changed); one agent per host
says which files its copy lacks, and only those travel: streamed to all hosts at once (stream.py), or in
batches well within MONARCH_MAX_FRAME. Then every rank puts its host's copy first on `sys.path` and reloads
the modules whose files changed, so actor classes of the user's package resolve on hosts without it.
"""
from __future__ import annotations

import graphlib
import hashlib
import importlib
import importlib.machinery
import os
import stat
import sys
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from monarch.cluster.copies import (MANIFEST, Manifest, Piece, WorkspaceError, copy_dir, delete, is_file,
                                    read_manifest, write_manifest, write_piece)
from monarch.cluster.stream import ENTRY_BYTES, Door, Signature, deliver, each, left, signature
from monarch.runtime.actors.endpoint import Actor, endpoint
from monarch.runtime.control.client import client

if TYPE_CHECKING:
    from monarch.runtime.actors.actor_mesh import ActorMesh
    from monarch.runtime.control.conn import Mesh
    from monarch.shape import Shape

AGENT_NAME = "monarch.workspace"  # the reserved actor name of the agents, one per rank
SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", ".hypothesis", ".pytest_cache"})
MAX_BATCH = 2 << 20  # bytes of file data per call, when MONARCH_MAX_FRAME allows
RACY_NS = 100_000_000  # a file whose timestamps are this recent is hashed again next time (see Source)
DEPTH = lambda name: (name.count("."), name)  # sort key: parents before children


class ProcMesh(Protocol):
    """What a sync uses of a ProcMesh (runtime/actors/proc_mesh.py, whose sync_workspace calls this module)."""
    _mesh: Mesh
    _shape: Shape
    hostnames: list[str]

    def _with_shape(self, shape: Shape) -> ProcMesh: ...

    def spawn(self, name: str, actor_cls: type) -> ActorMesh: ...


@dataclass(frozen=True)
class SyncReport:
    """What one sync did; counts of sent and deleted files are summed over the hosts."""
    hosts: tuple[str, ...]
    files_total: int
    files_sent: int
    bytes_sent: int
    files_deleted: int
    seconds: float
    reloaded: tuple[str, ...]
    remote_path: dict[str, str]  # hostname -> the copy on that host
    via: dict[str, str] = field(default_factory=dict)  # hostname -> "stream", "frames", or "" (nothing to send)


# --- the tree on the controller ------------------------------------------------------------------------

def file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def walk(root: Path, prefix: str = "") -> Iterator[tuple[str, Path]]:
    """(posix relpath, path) of each file to ship, sorted, a directory's files before its subdirectories:
    skipped names left out, linked directories not entered, and a linked file only when its target lies
    inside the tree."""
    with os.scandir(root / prefix if prefix else root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        rel = prefix + e.name
        if e.is_symlink():
            real = Path(e.path).resolve()
            shipped = real.is_file() and real.is_relative_to(root)
        else:
            shipped = e.is_file(follow_symlinks=False)
        if shipped and not e.name.endswith(".pyc") and rel != MANIFEST:
            yield rel, Path(e.path)
    for e in entries:
        if e.name not in SKIP_DIRS and e.is_dir(follow_symlinks=False):
            yield from walk(root, f"{prefix}{e.name}/")


def manifest(root: Path) -> Manifest:
    """{relpath: (size, sha256, permission bits)} of the files `walk` ships."""
    return {rel: (st.st_size, file_sha(path), stat.S_IMODE(st.st_mode)) for rel, path in walk(root)
            for st in (path.stat(),)}


_HASHED: dict[Path, dict[str, tuple[Signature, str]]] = {}  # root -> relpath -> (signature, sha256)


@dataclass
class Source:
    """The tree on the controller as one sync sees it: each file's size, mode and signature at the scan, and
    its sha256 once known: kept from an earlier scan while the signature holds, else computed when asked
    (only where a host holds a file of that size, before the files travel; the rest while they do)."""
    root: Path
    entries: dict[str, tuple[int, int]]  # relpath -> (size, permission bits)
    sigs: dict[str, Signature]
    shas: dict[str, str]
    racy: int  # ns since the epoch: a file with newer timestamps may change again within their granularity

    @classmethod
    def scan(cls, root: Path) -> Source:
        known = _HASHED.get(root, {})
        src = cls(root, {}, {}, {}, time.time_ns() - RACY_NS)
        for rel, path in walk(root):
            st = path.stat()
            src.entries[rel], src.sigs[rel] = (st.st_size, stat.S_IMODE(st.st_mode)), signature(st)
            if rel in known and known[rel][0] == src.sigs[rel]:
                src.shas[rel] = known[rel][1]
        _HASHED[root] = {rel: known[rel] for rel in src.shas}
        return src

    def files(self, rels: Iterable[str] | None = None) -> Manifest:
        """The manifest of `rels` (default all), "" for a hash not computed yet."""
        return {rel: (self.entries[rel][0], self.shas.get(rel, ""), self.entries[rel][1])
                for rel in (self.entries if rels is None else rels)}

    def hash(self, rels: Iterable[str]) -> Manifest:
        """Compute the missing hashes of `rels` (each file checked against its signature), remember those a
        later scan may trust; the manifest of `rels`."""
        rels = list(rels)
        for rel in rels:
            if rel not in self.shas:
                with open(self.root / rel, "rb") as f:
                    sha = hashlib.file_digest(f, "sha256").hexdigest()
                    if signature(os.fstat(f.fileno())) != self.sigs[rel]:
                        raise WorkspaceError(f"{self.root / rel} changed while it was being synced; sync again")
                self.shas[rel] = sha
        kept = _HASHED.setdefault(self.root, {})
        for rel in rels:
            _, mtime, ctime, _ = self.sigs[rel]
            if max(mtime, ctime) < self.racy:
                kept[rel] = (self.sigs[rel], self.shas[rel])
        return self.files(rels)


def copy_name(root: Path) -> str:
    """The copy's directory name on every host: `<basename>-<8 hex of the sha256 of the absolute path>`."""
    return f"{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"


def manifest_chunks(files: Manifest, budget: int) -> Iterator[Manifest]:
    """`files` in parts whose entries fit in one call each (at least one part, maybe empty)."""
    part: Manifest = {}
    used = 0
    for rel, entry in files.items():
        cost = len(os.fsencode(rel)) + ENTRY_BYTES
        if part and used + cost > budget:
            yield part
            part, used = {}, 0
        part[rel] = entry
        used += cost
    yield part


# --- the copy on a host (monarch/cluster/copies.py) ---------------------------------------------------

@dataclass
class Staged:
    """One sync in progress on a host's writer: the copy, what it held, what the source has, files begun, and
    the door of the stream, when one was opened."""
    copy: Path
    old: Manifest
    new: Manifest = field(default_factory=dict)
    hashers: dict[str, Any] = field(default_factory=dict)  # relpath -> sha256 of the pieces written so far
    door: Door | None = None


def reload_changed(copy: Path, changed: set[str]) -> list[str]:
    """Reload the imported modules whose files lie in `copy` and are in `changed` (and still exist)."""
    def hit(file: Path) -> bool:
        return file.is_relative_to(copy) and file.relative_to(copy).as_posix() in changed and file.is_file()
    order = reload_order({n: m for n, m in list(sys.modules.items()) if hit(Path(getattr(m, "__file__", None) or "/"))})
    for name in order:
        importlib.reload(sys.modules[name])
    return order


def reload_order(modules: dict[str, ModuleType]) -> list[str]:
    """A module whose names come from another one goes after it (`from a.b import f` in `a`: a.b first), else
    parents before children; a package's attributes for its own submodules do not count, and on a cycle
    parents simply go first."""
    graph = {name: {d for d in _sources_of(m) if d in modules and d != name} for name, m in modules.items()}
    sorter = graphlib.TopologicalSorter(graph)
    try:
        sorter.prepare()
    except graphlib.CycleError:
        return sorted(modules, key=DEPTH)
    order: list[str] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready(), key=DEPTH)
        order += ready
        sorter.done(*ready)
    return order


def _sources_of(module: ModuleType) -> set[str]:
    """The modules that the functions, classes and modules bound in `module` come from."""
    found = set()
    for key, value in vars(module).items():
        if isinstance(value, ModuleType) and value.__name__ != f"{module.__name__}.{key}":
            found.add(value.__name__)
        elif isinstance(value, (type, FunctionType)):
            found.add(str(getattr(value, "__module__", "")))
    return found


class WorkspaceAgent(Actor):
    """One per rank: the first rank of each host keeps that host's copy up to date; every rank activates it."""

    def __init__(self) -> None:
        self._staged: dict[str, Staged] = {}
        self._seen: dict[str, dict[str, str]] = {}  # copy name -> {source relpath: sha} as last reloaded

    @endpoint
    def compare(self, name: str, files: Manifest, first: bool) -> tuple[list[str], list[str]]:
        """The relpaths of `files` the copy lacks or holds with another size, mode or hash, and those it holds
        with the same size and mode whose hash the controller did not send (`first`: a new sync)."""
        if first:
            copy = copy_dir(name)
            self._staged[name] = Staged(copy, read_manifest(copy))
        staged = self._staged[name]
        staged.new.update(files)
        lacking, unsure = [], []
        for rel, (size, sha, mode) in files.items():
            old = staged.old.get(rel)
            if old is None or (old[0], old[2]) != (size, mode) or not is_file(staged.copy / rel, size):
                lacking.append(rel)
            elif old[1] != sha:
                (lacking if sha else unsure).append(rel)
        return lacking, unsure

    @endpoint
    def record(self, name: str, files: Manifest) -> None:
        """The hashes of files compared without one."""
        self._staged[name].new.update(files)

    @endpoint
    def prune(self, name: str) -> int:
        """Delete what the copy held and the source no longer has; how many files."""
        staged = self._staged[name]
        gone = [rel for rel in staged.old if rel not in staged.new]
        for rel in gone:
            delete(staged.copy, rel)
        return len(gone)

    @endpoint
    def open_door(self, name: str, timeout: float) -> tuple[str, int, bytes] | None:
        """Where the controller streams the files (address and key); None where no door can be opened."""
        staged = self._staged[name]
        try:
            staged.door = Door(client().reach_host(), staged.copy, timeout)
        except OSError:
            return None
        return (*staged.door.address, staged.door.key)

    @endpoint
    def write(self, name: str, pieces: list[Piece]) -> None:
        staged = self._staged[name]
        for piece in pieces:
            write_piece(staged.copy, piece, staged.hashers)

    @endpoint
    def finish(self, name: str) -> str:
        staged = self._staged.pop(name)
        if staged.door is not None:
            staged.door.close()
        assert all(sha for _, sha, _ in staged.new.values()), "a file of the manifest has no hash"
        if staged.new != staged.old or not is_file(staged.copy / MANIFEST):
            write_manifest(staged.copy, staged.new)
        return str(staged.copy)

    @endpoint
    def activate(self, name: str, reload: bool) -> list[str]:
        """Put the copy first on sys.path (once); with `reload`, reload the modules whose sources changed
        since this rank last reloaded. Returns the reloaded module names."""
        copy = copy_dir(name)
        if str(copy) not in sys.path:
            sys.path.insert(0, str(copy))
        importlib.invalidate_caches()
        if not reload:
            return []
        suffixes = tuple(importlib.machinery.SOURCE_SUFFIXES)
        now = {rel: sha for rel, (_, sha, _) in read_manifest(copy).items() if rel.endswith(suffixes)}
        before = self._seen.get(name, {})
        done = reload_changed(copy, {rel for rel in before.keys() | now.keys() if before.get(rel) != now.get(rel)})
        self._seen[name] = now
        return done


# --- the controller's side -----------------------------------------------------------------------------

_AGENTS: weakref.WeakKeyDictionary[Mesh, ActorMesh] = weakref.WeakKeyDictionary()  # on all ranks of the mesh


def writers(procs: ProcMesh) -> dict[str, ActorMesh]:
    """hostname (as each rank reported it) -> the agent of the first rank of this view on that host; the
    mesh's agents are spawned on its first sync."""
    mesh = procs._mesh
    if mesh not in _AGENTS:
        _AGENTS[mesh] = procs._with_shape(mesh.shape).spawn(AGENT_NAME, WorkspaceAgent)
    first: dict[str, int] = {}
    for rank, host in zip(procs._shape.ranks(), procs.hostnames, strict=True):
        first.setdefault(host, rank)
    return {host: _AGENTS[mesh].slice(**mesh.shape.point(rank)) for host, rank in first.items()}


def compare(hosts: dict[str, ActorMesh], name: str, source: Source, budget: int,
            deadline: float) -> dict[str, list[str]]:
    """hostname -> the relpaths its copy lacks; files a host holds with the size and mode of the source are
    hashed (if they were not) and compared again."""
    wanted: dict[str, list[str]] = {host: [] for host in hosts}
    unsure: dict[str, list[str]] = {host: [] for host in hosts}
    for i, part in enumerate(manifest_chunks(source.files(), budget)):
        for host, (lacking, maybe) in each(hosts, lambda a: a.compare.call_one(name, part, i == 0), deadline).items():
            wanted[host] += lacking
            unsure[host] += maybe
    source.hash(sorted(set().union(*unsure.values())))
    again = {host: [hosts[host].compare.call_one(name, part, False) for part in manifest_chunks(
        source.files(rels), budget)] for host, rels in unsure.items() if rels}
    for host, futures in again.items():
        for fut in futures:
            wanted[host] += fut.get(timeout=left(deadline))[0]
    return wanted


def send_and_hash(hosts: dict[str, ActorMesh], wanted: dict[str, list[str]], name: str, source: Source,
                  budget: int, deadline: float) -> dict[str, str]:
    """Deliver the wanted files (stream.deliver) while the hashes not computed yet are, then hand the hosts
    those hashes; hostname -> how its files went."""
    with ThreadPoolExecutor(1, "monarch-workspace-hash") as pool:
        hashing = pool.submit(source.hash, [rel for rel in source.entries if rel not in source.shas])

        def hashed() -> Manifest:
            hashing.result(timeout=left(deadline))
            return source.files()
        via = deliver(hosts, wanted, name, source.root, source.files(), source.sigs, budget, deadline, hashed)
        late = hashing.result(timeout=left(deadline))
    for part in manifest_chunks(late, budget) if late else ():
        each(hosts, lambda a: a.record.call_one(name, part), deadline)
    return via


def sync_workspace(procs: ProcMesh, path: str | os.PathLike[str], *, reload: bool = True,
                   timeout: float = 300) -> SyncReport:
    """Copy directory `path` to every host of `procs` (only what changed since the last sync), put the copy
    first on each worker's sys.path and, with `reload`, reload the changed modules the workers imported."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        why = "is not a directory" if root.exists() else "does not exist"
        raise WorkspaceError(f"sync_workspace copies a directory; {os.fspath(path)!r} ({root}) {why}")
    source = Source.scan(root)
    hosts = writers(procs)
    name, budget = copy_name(root), min(procs._mesh.max_frame // 2, MAX_BATCH)  # bytes of paths and data per call
    wanted = compare(hosts, name, source, budget, deadline)
    deleted = each(hosts, lambda a: a.prune.call_one(name), deadline)
    via = send_and_hash(hosts, wanted, name, source, budget, deadline)
    remote = each(hosts, lambda a: a.finish.call_one(name), deadline)
    view = _AGENTS[procs._mesh]._with_shape(procs._shape)  # the agents of this view's ranks
    reloaded = view.activate.call(name, reload).get(timeout=left(deadline)).values()
    return SyncReport(
        hosts=tuple(hosts), files_total=len(source.entries), files_sent=sum(map(len, wanted.values())),
        bytes_sent=sum(source.entries[rel][0] for w in wanted.values() for rel in w),
        files_deleted=sum(deleted.values()),
        seconds=time.monotonic() - t0, reloaded=tuple(dict.fromkeys(n for names in reloaded for n in names)),
        remote_path=remote, via=via)
