"""Workspace sync: copy a directory of the user's code to every host of a proc mesh, once per content change.

The controller hashes the tree; one agent per host says which files its copy lacks, and only those travel,
in batches well within MONARCH_MAX_FRAME. Then every rank puts its host's copy first on `sys.path` and
reloads the modules whose files changed, so actor classes of the user's package resolve on hosts without it.
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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from monarch.cluster.copies import (MANIFEST, Manifest, Piece, WorkspaceError, copy_dir, delete, is_file,
                                    read_manifest, write_manifest, write_piece)
from monarch.runtime.actors.endpoint import Actor, endpoint

if TYPE_CHECKING:
    from monarch.runtime.actors.actor_mesh import ActorMesh
    from monarch.runtime.control.conn import Mesh
    from monarch.runtime.control.futures import Future
    from monarch.shape import Shape

AGENT_NAME = "monarch.workspace"  # the reserved actor name of the agents, one per rank
SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", ".hypothesis", ".pytest_cache"})
MAX_BATCH = 2 << 20  # bytes of file data per call, when MONARCH_MAX_FRAME allows
ENTRY_BYTES = 160  # pickled size of one entry's fields besides its path and data
WINDOW = 4  # write calls in flight per host
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


# --- the tree on the controller ------------------------------------------------------------------------

def file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(posix relpath, path) of each file to ship, sorted: skipped names left out, linked directories not
    entered, and a linked file only when its target lies inside the tree."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel, real = path.relative_to(root).as_posix(), path.resolve()
            if not name.endswith(".pyc") and rel != MANIFEST and real.is_file() and real.is_relative_to(root):
                yield rel, path


def manifest(root: Path) -> Manifest:
    """{relpath: (size, sha256, permission bits)} of the files `walk` ships."""
    return {rel: (st.st_size, file_sha(path), stat.S_IMODE(st.st_mode)) for rel, path in walk(root)
            for st in (path.stat(),)}


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


def batches(root: Path, wanted: list[str], files: Manifest, budget: int) -> Iterator[list[Piece]]:
    """The wanted files as write batches: small files share a batch, a large one goes in pieces."""
    batch: list[Piece] = []
    used = 0
    for rel in wanted:
        size, sha, mode = files[rel]
        meta = len(os.fsencode(rel)) + ENTRY_BYTES
        with open(root / rel, "rb") as f:
            offset = 0
            while True:
                room = budget - used - meta
                if room <= 0:
                    if not batch:
                        raise WorkspaceError(f"the path {rel!r} is too long to send within MONARCH_MAX_FRAME; raise it")
                    yield batch
                    batch, used = [], 0
                    continue
                want = min(room, size - offset)
                data = f.read(want)
                if len(data) < want:
                    raise WorkspaceError(f"{root / rel} shrank while it was being sent; sync again")
                batch.append((rel, offset, data, size, sha, mode))
                used += meta + len(data)
                offset += len(data)
                if offset >= size:
                    break
    if batch:
        yield batch


# --- the copy on a host (monarch/cluster/copies.py) ---------------------------------------------------

@dataclass
class Staged:
    """One sync in progress on a host's writer: the copy, what it held, what the source has, files begun."""
    copy: Path
    old: Manifest
    new: Manifest = field(default_factory=dict)
    hashers: dict[str, Any] = field(default_factory=dict)  # relpath -> sha256 of the pieces written so far


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
    def compare(self, name: str, files: Manifest, first: bool) -> list[str]:
        """The relpaths of `files` the copy lacks or holds with another size or hash (`first`: a new sync)."""
        if first:
            copy = copy_dir(name)
            self._staged[name] = Staged(copy, read_manifest(copy))
        staged = self._staged[name]
        staged.new.update(files)
        return [rel for rel, entry in files.items()
                if staged.old.get(rel) != tuple(entry) or not is_file(staged.copy / rel, entry[0])]

    @endpoint
    def prune(self, name: str) -> int:
        """Delete what the copy held and the source no longer has; how many files."""
        staged = self._staged[name]
        gone = [rel for rel in staged.old if rel not in staged.new]
        for rel in gone:
            delete(staged.copy, rel)
        return len(gone)

    @endpoint
    def write(self, name: str, pieces: list[Piece]) -> None:
        staged = self._staged[name]
        for piece in pieces:
            write_piece(staged.copy, piece, staged.hashers)

    @endpoint
    def finish(self, name: str) -> str:
        staged = self._staged.pop(name)
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


def left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def send_files(hosts: dict[str, ActorMesh], wanted: dict[str, list[str]], name: str, root: Path,
               files: Manifest, budget: int, deadline: float) -> None:
    """Write each host's wanted files, hosts taking turns, at most WINDOW calls in flight per host."""
    streams = {host: batches(root, wanted[host], files, budget) for host in hosts}
    inflight: deque[Future[None]] = deque()
    while streams:
        for host, stream in list(streams.items()):
            batch = next(stream, None)
            if batch is None:
                del streams[host]
                continue
            inflight.append(hosts[host].write.call_one(name, batch))
            while len(inflight) > WINDOW * len(hosts):
                inflight.popleft().get(timeout=left(deadline))
    for fut in inflight:
        fut.get(timeout=left(deadline))


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
    files = manifest(root)
    hosts = writers(procs)
    name, budget = copy_name(root), min(procs._mesh.max_frame // 2, MAX_BATCH)  # bytes of paths and data per call
    wanted: dict[str, list[str]] = {host: [] for host in hosts}
    for i, part in enumerate(manifest_chunks(files, budget)):
        for host, lacking in _each(hosts, lambda a: a.compare.call_one(name, part, i == 0), deadline).items():
            wanted[host] += lacking
    deleted = _each(hosts, lambda a: a.prune.call_one(name), deadline)
    send_files(hosts, wanted, name, root, files, budget, deadline)
    remote = _each(hosts, lambda a: a.finish.call_one(name), deadline)
    view = _AGENTS[procs._mesh]._with_shape(procs._shape)  # the agents of this view's ranks
    reloaded = view.activate.call(name, reload).get(timeout=left(deadline)).values()
    return SyncReport(
        hosts=tuple(hosts), files_total=len(files), files_sent=sum(map(len, wanted.values())),
        bytes_sent=sum(files[rel][0] for w in wanted.values() for rel in w), files_deleted=sum(deleted.values()),
        seconds=time.monotonic() - t0, reloaded=tuple(dict.fromkeys(n for names in reloaded for n in names)),
        remote_path=remote)


def _each(hosts: dict[str, ActorMesh], call: Callable[[ActorMesh], Future[Any]], deadline: float) -> dict[str, Any]:
    """Start `call(agent)` on every host's writer, then wait for all: hostname -> answer."""
    futures = {host: call(agent) for host, agent in hosts.items()}
    return {host: fut.get(timeout=left(deadline)) for host, fut in futures.items()}
