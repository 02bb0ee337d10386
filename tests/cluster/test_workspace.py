"""sync_workspace on a local 2-process mesh whose workers never had the package: it arrives and its actors run
from the copy, an edit travels alone and is reloaded, deletions follow, a file larger than the mesh's small
MONARCH_MAX_FRAME arrives intact in pieces, and a reload that raises comes back as an ActorError.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import py_compile
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch.actor import ActorError, ProcMesh, this_host
from monarch.cluster.copies import MANIFEST, WorkspaceError, delete, write_piece
from monarch.cluster.stream import ENTRY_BYTES, batches
from monarch.cluster.workspace import copy_name, manifest, reload_order, sync_workspace, walk

T = 60  # seconds: bound of every wait
LIMIT = 256 << 10  # MONARCH_MAX_FRAME of the mesh: a batch is at most half of it

INIT = '''from monarch.actor import Actor, endpoint

from {pkg} import util
from {pkg}.util import answer as reexported


class Greeter(Actor):
    @endpoint
    def answer(self) -> int:
        return util.answer()

    @endpoint
    def reexport(self) -> int:
        return reexported()

    @endpoint
    def where(self) -> str:
        return util.__file__
'''


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workspaces")


SHADOWED = "wspkg_copy_comes_first"  # a package the workers also find in a directory on their PYTHONPATH


@pytest.fixture(scope="module")
def small(workspaces: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcMesh]:
    """Two workers whose control plane takes frames of at most LIMIT bytes, keeping copies in `workspaces`,
    writing bytecode (as users' interpreters do), with an older SHADOWED package on their PYTHONPATH."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / SHADOWED).mkdir()
    (shadow / SHADOWED / "__init__.py").write_text(INIT.format(pkg=SHADOWED))
    (shadow / SHADOWED / "util.py").write_text("def answer() -> int:\n    return 0\n")
    env = {"MONARCH_WORKSPACE_DIR": str(workspaces), "PYTHONDONTWRITEBYTECODE": "", "PYTHONPATH": str(shadow)}
    os.environ["MONARCH_MAX_FRAME"] = str(LIMIT)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="workspace", env=env)
    finally:
        del os.environ["MONARCH_MAX_FRAME"]
    with procs:
        yield procs


@dataclass(frozen=True)
class Package:
    """A package `name` in directory `src`, importable here but never on the workers' sys.path at spawn."""
    src: Path
    name: str
    copy: Path  # where the workers' host keeps the copy of `src`

    @property
    def util(self) -> Path:
        return self.src / self.name / "util.py"

    def set_answer(self, source: str) -> None:
        self.util.write_text(f"def answer() -> int:\n    {source}\n")


@pytest.fixture
def package(tmp_path: Path, workspaces: Path, small: ProcMesh, request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Package]:
    name = f"wspkg_{request.node.name.removeprefix('test_')}"
    src = tmp_path / "src"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text(INIT.format(pkg=name))
    pkg = Package(src, name, workspaces / socket.gethostname() / copy_name(src.resolve()))
    pkg.set_answer("return 1")
    monkeypatch.syspath_prepend(str(src))  # after the spawn: the workers' PYTHONPATH does not hold it
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def greeter(procs: ProcMesh, pkg: Package, actor: str) -> Any:
    return procs.spawn(actor, importlib.import_module(pkg.name).Greeter)


def test_package_arrives_and_actors_run_from_the_copy(small: ProcMesh, package: Package) -> None:
    early = greeter(small, package, "early")
    with pytest.raises(ActorError, match=f"No module named '{package.name}'"):
        early.answer.call().get(timeout=T)
    report = sync_workspace(small, package.src)
    sizes = sum(p.stat().st_size for p in (package.src / package.name).iterdir())
    assert (report.files_total, report.files_sent, report.bytes_sent, report.files_deleted) == (2, 2, sizes, 0)
    assert report.hosts == (socket.gethostname(),) and report.reloaded == ()
    assert report.remote_path == {socket.gethostname(): str(package.copy)}
    g = greeter(small, package, "greeter")
    assert g.answer.call().get(timeout=T).values() == [1, 1]
    where = g.where.call().get(timeout=T).values()
    assert where == [str(package.copy / package.name / "util.py")] * 2, where


def test_edit_travels_alone_and_is_reloaded(small: ProcMesh, package: Package) -> None:
    sync_workspace(small, package.src)
    g = greeter(small, package, "before_edit")
    assert g.answer.call().get(timeout=T).values() == [1, 1]
    package.set_answer("return 2")  # same size, within the same second: the old bytecode must not be used
    report = sync_workspace(small, package.src)
    assert (report.files_sent, report.bytes_sent) == (1, package.util.stat().st_size)
    assert report.reloaded == (f"{package.name}.util",)
    assert g.answer.call().get(timeout=T).values() == [2, 2]
    fresh = greeter(small, package, "after_edit")
    assert fresh.answer.call().get(timeout=T).values() == [2, 2]
    again = sync_workspace(small, package.src)
    assert (again.files_sent, again.bytes_sent, again.files_deleted, again.reloaded) == (0, 0, 0, ())
    (package.copy / package.name / "util.py").unlink()  # the copy lost a file it listed: sent again
    assert sync_workspace(small, package.src).files_sent == 1
    assert (package.copy / package.name / "util.py").read_bytes() == package.util.read_bytes()


def test_a_module_reloads_after_the_modules_it_takes_names_from(small: ProcMesh, package: Package) -> None:
    sync_workspace(small, package.src)
    g = greeter(small, package, "reexporter")
    assert g.reexport.call().get(timeout=T).values() == [1, 1]
    package.set_answer("return 4")
    init = package.src / package.name / "__init__.py"
    init.write_text(init.read_text() + "# edited\n")
    report = sync_workspace(small, package.src)
    assert report.reloaded == (f"{package.name}.util", package.name)  # the parent first would keep answer 1
    assert g.reexport.call().get(timeout=T).values() == [4, 4]


def test_reload_order() -> None:
    """Names taken from a module put it first; a package's own submodule attributes do not; cycles fall back
    to parents first."""
    def module(name: str, **names: object) -> ModuleType:
        m = ModuleType(name)
        vars(m).update(names)
        return m

    def f() -> None: ...
    f.__module__ = "a.b"
    b, c = module("a.b"), module("a.c")
    assert reload_order({"a.b": b, "a": module("a", b=b, f=f)}) == ["a.b", "a"]
    assert reload_order({"a.c": c, "a": module("a", c=c)}) == ["a", "a.c"]
    assert reload_order({"a.b": module("a.b", g=module("a")), "a": module("a", f=f)}) == ["a", "a.b"]


def test_copy_comes_first(small: ProcMesh, package: Package) -> None:
    """The copy goes first on the workers' sys.path, before an older package their PYTHONPATH holds."""
    assert package.name == SHADOWED
    assert small.sync_workspace(package.src).files_sent == 2  # the method of ProcMesh
    g = greeter(small, package, "shadowed")
    assert g.answer.call().get(timeout=T).values() == [1, 1]  # the shadow says 0


def test_deleted_files_leave_the_copy(small: ProcMesh, package: Package) -> None:
    (package.src / package.name / "extra.py").write_text("X = 1\n")
    (package.src / "data" / "deep").mkdir(parents=True)
    (package.src / "data" / "deep" / "blob.txt").write_text("blob")
    assert sync_workspace(small, package.src).files_sent == 4
    assert (package.copy / package.name / "extra.py").is_file() and (package.copy / "data/deep/blob.txt").is_file()
    (package.src / package.name / "extra.py").unlink()
    (package.src / "data" / "deep" / "blob.txt").unlink()
    report = sync_workspace(small.slice(gpus=1), package.src)  # a view: the agents are the mesh's own
    assert (report.files_total, report.files_sent, report.files_deleted) == (2, 0, 2)
    assert not (package.copy / package.name / "extra.py").exists() and not (package.copy / "data").exists()
    assert sorted(json.loads((package.copy / MANIFEST).read_text())) == [f"{package.name}/__init__.py",
                                                                         f"{package.name}/util.py"]


def tree(root: Path) -> dict[str, bytes]:
    """relpath -> content of every file under `root` but the copy's manifest and bytecode."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts}


def test_large_and_many_files_arrive_intact_within_the_frame_limit(small: ProcMesh, package: Package,
                                                                   tmp_path: Path) -> None:
    src = package.src
    big = os.urandom(3 * LIMIT + 12345)
    (src / "big.bin").write_bytes(big)
    (src / "many").mkdir()
    for i in range(40):
        (src / "many" / f"f{i:02}.bin").write_bytes(os.urandom(8 << 10))
    (src / "empty").write_bytes(b"")
    for skipped in [".git/config", "__pycache__/x.pyc", "mod.pyc", ".venv/lib.py", ".pytest_cache/v"]:
        (src / skipped).parent.mkdir(parents=True, exist_ok=True)
        (src / skipped).write_text("not shipped")
    (tmp_path / "secret.txt").write_text("outside the tree")
    os.symlink(tmp_path / "secret.txt", src / "outside")
    os.symlink(src / "many" / "f00.bin", src / "inside")
    report = sync_workspace(small, src)
    expected = {rel: p.read_bytes() for rel, p in walk(src.resolve())}
    assert "outside" not in expected and expected["inside"] == expected["many/f00.bin"]
    assert len(expected) == 2 + 1 + 40 + 1 + 1
    assert tree(package.copy) == expected
    assert (report.files_sent, report.bytes_sent) == (len(expected), sum(map(len, expected.values())))
    changed = bytearray(big)
    changed[LIMIT + 7] ^= 0xFF
    (src / "big.bin").write_bytes(changed)
    again = sync_workspace(small, src)
    assert (again.files_sent, again.bytes_sent) == (1, len(big))
    assert (package.copy / "big.bin").read_bytes() == bytes(changed)


def test_failing_reload_is_an_actor_error_and_a_fix_recovers(small: ProcMesh, package: Package) -> None:
    sync_workspace(small, package.src)
    g = greeter(small, package, "reloaded")
    assert g.answer.call().get(timeout=T).values() == [1, 1]
    package.set_answer("return (")
    with pytest.raises(ActorError) as info:
        sync_workspace(small, package.src)
    assert info.value.rank in (0, 1) and info.value.exc_type == "SyntaxError"
    assert "activate" in info.value.what and "reload" in info.value.remote_traceback
    package.set_answer("return 3")
    report = sync_workspace(small, package.src)
    assert report.reloaded == (f"{package.name}.util",)
    assert g.answer.call().get(timeout=T).values() == [3, 3]


def test_a_path_that_is_not_a_directory_is_refused(small: ProcMesh, tmp_path: Path) -> None:
    (tmp_path / "file.py").write_text("")
    for path in [tmp_path / "file.py", tmp_path / "missing"]:
        with pytest.raises(WorkspaceError, match=str(path)):
            sync_workspace(small, path)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8), budget=st.integers(700, 4000))
def test_batches_fit_the_budget_and_reassemble(sizes: list[int], budget: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, n in enumerate(sizes):
            (root / f"f{i}").write_bytes(os.urandom(n))
        files = manifest(root)
        got: dict[str, bytearray] = {rel: bytearray() for rel in files}
        for batch in batches(root, sorted(files), files, budget):
            assert sum(len(rel) + ENTRY_BYTES + len(data) for rel, _, data, _, _, _ in batch) <= budget
            for rel, offset, data, size, sha, mode in batch:
                assert offset == len(got[rel]) and (size, sha, mode) == files[rel]
                got[rel] += data
        assert {rel: bytes(b) for rel, b in got.items()} == {rel: (root / rel).read_bytes() for rel in files}


def test_replacing_or_deleting_a_source_drops_its_bytecode(tmp_path: Path) -> None:
    """A pyc holds its source's mtime in whole seconds and its size: an edit of the same size within the same
    second would pass for unchanged if the old pyc stayed."""
    source = tmp_path / "pkg" / "m.py"
    source.parent.mkdir()
    source.write_text("A = 1\n")
    pyc = Path(importlib.util.cache_from_source(str(source)))
    for step in ["replace", "delete"]:
        py_compile.compile(str(source), cfile=str(pyc), doraise=True)
        assert pyc.is_file()
        if step == "replace":
            write_piece(tmp_path, ("pkg/m.py", 0, b"A = 2\n", 6, hashlib.sha256(b"A = 2\n").hexdigest(), 0o644), {})
            assert source.read_text() == "A = 2\n"
        else:
            delete(tmp_path, "pkg/m.py")
            assert not source.parent.exists()  # nor the directories it leaves empty
        assert not pyc.exists(), step


def test_a_file_that_arrives_with_another_hash_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(WorkspaceError, match="arrived with another sha256"):
        write_piece(tmp_path, ("f", 0, b"new", 3, hashlib.sha256(b"other").hexdigest(), 0o644), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and (tmp_path / "f").read_bytes() == b"old"
    with pytest.raises(WorkspaceError, match="not a path inside the copy"):
        write_piece(tmp_path, ("../escape", 0, b"x", 1, hashlib.sha256(b"x").hexdigest(), 0o644), {})


def test_links_in_the_copy_are_replaced_not_followed(small: ProcMesh, package: Package, tmp_path: Path) -> None:
    """Links already in the copy (a shared or tampered workspace directory) never carry a write outside it."""
    sync_workspace(small, package.src)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim").write_text("keep")
    util = package.copy / package.name / "util.py"
    util.unlink()
    util.symlink_to(outside / "victim")  # a synced file replaced by a link
    (package.copy / "data").symlink_to(outside / "dir", target_is_directory=True)  # a directory's place taken
    package.set_answer("return 5")
    (package.src / "data").mkdir()
    (package.src / "data" / "new.txt").write_text("new")
    dest = package.copy / "data" / "new.txt"
    (outside / "dir" / "new.txt").symlink_to(outside / "victim")
    sync_workspace(small, package.src)
    assert (outside / "victim").read_text() == "keep" and sorted(os.listdir(outside / "dir")) == ["new.txt"]
    assert not util.is_symlink() and "return 5" in util.read_text()
    assert not dest.parent.is_symlink() and dest.read_text() == "new"
    assert greeter(small, package, "after_links").answer.call().get(timeout=T).values() == [5, 5]


def test_a_workspace_directory_others_can_write_is_refused(small: ProcMesh, package: Package,
                                                           workspaces: Path) -> None:
    host = workspaces / socket.gethostname()
    sync_workspace(small, package.src)
    host.chmod(0o777)
    try:
        with pytest.raises(ActorError, match="writable by others"):
            sync_workspace(small, package.src)
    finally:
        host.chmod(0o700)
    sync_workspace(small, package.src)
    assert stat.S_IMODE(host.stat().st_mode) == 0o700 and stat.S_IMODE(package.copy.stat().st_mode) == 0o700


def test_modes_long_names_and_names_that_are_not_utf8_arrive(small: ProcMesh, package: Package) -> None:
    data = package.src / "data"
    data.mkdir()
    (data / "secret").write_text("s")
    (data / "secret").chmod(0o600)
    (data / "run.sh").write_text("#!/bin/sh\n")
    (data / "run.sh").chmod(0o755)
    long = "x" * 250 + ".txt"  # 254 bytes: a part file named after it would pass 255
    (data / long).write_text("long")
    odd = os.fsdecode(b"caf\xe9.txt")  # latin-1, not UTF-8
    (data / odd).write_text("odd")
    for _ in range(2):  # the next sync of the tree works too
        sync_workspace(small, package.src)
        copy = package.copy / "data"
        assert stat.S_IMODE((copy / "secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((copy / "run.sh").stat().st_mode) == 0o755
        assert (copy / long).read_text() == "long" and (copy / odd).read_text() == "odd"
    (data / "run.sh").chmod(0o700)  # a mode change alone travels
    assert sync_workspace(small, package.src).files_sent == 1
    assert stat.S_IMODE((package.copy / "data" / "run.sh").stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_workspace_directory_of_another_user_is_refused(small: ProcMesh, package: Package,
                                                          workspaces: Path) -> None:
    copy = package.copy
    sync_workspace(small, package.src)
    os.chown(copy, 65534, 65534)  # nobody's, as if they had made it first
    try:
        with pytest.raises(ActorError, match="owned by uid 65534"):
            sync_workspace(small, package.src)
    finally:
        os.chown(copy, 0, 0)
