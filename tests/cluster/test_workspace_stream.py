"""How sync_workspace's files travel: streamed into each host's door, or in control-plane frames (the fallback,
and MONARCH_WORKSPACE_STREAM=0). Both land the same tree, through the same edits; a door that cannot be reached
falls back to frames; the door refuses a wrong key and a path outside the copy; the sender refuses a file that
changed since it was hashed; the controller hashes again only what changed.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

import pytest
import test_workspace as base

from monarch.actor import ActorError, ProcMesh
from monarch.cluster import stream
from monarch.cluster.copies import MANIFEST, WorkspaceError
from monarch.cluster.stream import HEAD, Door, connect, send, signature
from monarch.cluster.workspace import _HASHED, RACY_NS, Source, copy_name, manifest, sync_workspace, walk

HOST = socket.gethostname()
LIMIT, Package, tree = base.LIMIT, base.Package, base.tree
small, package, workspaces = base.small, base.package, base.workspaces  # test_workspace's fixtures


def fill(src: Path) -> None:
    """Nested directories, an empty file, an executable, a file larger than the frame limit, many small ones."""
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "c.txt").write_text("deep")
    (src / "empty").write_bytes(b"")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "big.bin").write_bytes(os.urandom(3 * LIMIT + 4321))
    (src / "many").mkdir()
    for i in range(30):
        (src / "many" / f"f{i:02}.bin").write_bytes(os.urandom(4000 + i))


def modes(root: Path) -> dict[str, int]:
    return {rel: stat.S_IMODE(os.stat(root / rel).st_mode) for rel in tree(root)}


def test_stream_and_frames_land_the_same_tree_through_edits(small: ProcMesh, package: Package, tmp_path: Path,
                                                            workspaces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(package.src)
    twin = tmp_path / "twin"
    shutil.copytree(package.src, twin, symlinks=True)
    ways = {package.src: ("1", "stream", package.copy),
            twin: ("0", "frames", workspaces / HOST / copy_name(twin.resolve()))}

    def sync_both(sent: int, deleted: int) -> None:
        for src, (flag, how, copy) in ways.items():
            monkeypatch.setenv("MONARCH_WORKSPACE_STREAM", flag)
            report = sync_workspace(small, src)
            assert (report.files_sent, report.files_deleted) == (sent, deleted), (how, report)
            assert report.via == {HOST: how if sent else ""}
            expected = {rel: p.read_bytes() for rel, p in walk(src.resolve())}
            assert tree(copy) == expected and modes(copy) == modes(src), how
        assert tree(package.copy) == tree(ways[twin][2])

    sync_both(sent=2 + 34, deleted=0)
    for src in ways:
        (src / package.name / "util.py").write_text("def answer() -> int:\n    return 7\n")  # changed
        (src / "a" / "new.txt").write_text("new")  # new
        (src / "a" / "b" / "c.txt").unlink()  # deleted
    sync_both(sent=2, deleted=1)
    assert not (package.copy / "a" / "b").exists()
    sync_both(sent=0, deleted=0)


def test_a_door_the_controller_cannot_reach_falls_back_to_frames(small: ProcMesh, package: Package,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """As where a firewall refuses the connection: the same files arrive in frames, and the next sync streams."""
    fill(package.src)

    def refused(*args: object, **kwargs: object) -> socket.socket:
        raise ConnectionRefusedError("refused by the test's firewall")
    with monkeypatch.context() as m:
        m.setattr(stream.socket, "create_connection", refused)
        report = sync_workspace(small, package.src)
    assert report.via == {HOST: "frames"} and report.files_sent == 2 + 34
    assert tree(package.copy) == {rel: p.read_bytes() for rel, p in walk(package.src.resolve())}
    (package.src / "empty").write_text("not any more")
    assert sync_workspace(small, package.src).via == {HOST: "stream"}
    assert (package.copy / "empty").read_text() == "not any more"


def serve(copy: Path) -> Door:
    copy.mkdir(exist_ok=True)
    return Door("127.0.0.1", copy, timeout=30)


def test_the_door_takes_only_its_key_and_only_paths_inside_the_copy(tmp_path: Path) -> None:
    door = serve(tmp_path / "copy")
    with socket.create_connection(door.address) as wrong:
        wrong.sendall(bytes(len(door.key)))
        assert wrong.recv(1) == b""  # closed on us
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    send(connect(door.address, door.key, time.monotonic() + 10), src, [("f", 0o640, signature(os.stat(src / "f")))],
         time.monotonic() + 10)
    assert door.close() == 1 and (tmp_path / "copy" / "f").read_bytes() == b"data"
    assert stat.S_IMODE(os.stat(tmp_path / "copy" / "f").st_mode) == 0o640

    door = serve(tmp_path / "copy")
    sock = connect(door.address, door.key, time.monotonic() + 10)
    sock.sendall(HEAD.pack(len(b"../escape"), 1, 0o644) + b"../escape" + b"x")
    with pytest.raises(WorkspaceError, match="not a path inside the copy"):
        door.close()
    sock.close()
    assert not (tmp_path / "escape").exists()


def test_the_sender_refuses_a_file_that_changed_since_it_was_hashed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"old")
    hashed = signature(os.stat(src / "f"))
    time.sleep(0.01)
    (src / "f").write_bytes(b"new")  # same size
    door = serve(tmp_path / "copy")
    with pytest.raises(WorkspaceError, match="changed while it was being sent"):
        send(connect(door.address, door.key, time.monotonic() + 10), src, [("f", 0o644, hashed)],
             time.monotonic() + 10)
    with pytest.raises(WorkspaceError, match="ended early"):
        door.close()


def test_a_scan_trusts_a_hash_while_the_signature_holds(tmp_path: Path) -> None:
    root = (tmp_path / "tree").resolve()
    root.mkdir()
    for name in ("a", "b"):
        (root / name).write_text(name * 10)
    old = time.time_ns() - 10**9  # a second ago: older than the racy window
    for name in ("a", "b"):
        os.utime(root / name, ns=(old, old))
    assert Source.scan(root).shas == {}  # nothing hashed yet
    time.sleep(RACY_NS / 1e9 + 0.05)  # the ctime (utime set it to now) leaves the racy window
    first = Source.scan(root).hash(["a", "b"])
    assert Source.scan(root).shas == {"a": first["a"][1], "b": first["b"][1]}
    (root / "a").write_text("z" * 10)  # same size,
    os.utime(root / "a", ns=(old, old))  # same mtime: only the ctime tells
    again = Source.scan(root)
    assert again.shas == {"b": first["b"][1]}
    assert again.hash(["a"])["a"][1] != first["a"][1]
    assert Source.scan(root).shas == {"b": first["b"][1]}  # just changed: hashed again next time too


def test_a_new_controller_hashes_what_the_hosts_hold_and_sends_nothing(small: ProcMesh, package: Package) -> None:
    """Without the hashes of an earlier scan (a new controller process), files a host holds with the same size
    and mode are hashed and compared again: only what differs travels, and the manifest keeps every hash."""
    fill(package.src)
    sync_workspace(small, package.src)
    _HASHED.clear()
    (package.src / "run.sh").write_text("#!/bin/rc\n")  # same size, another hash
    report = sync_workspace(small, package.src)
    assert (report.files_sent, report.via) == (1, {HOST: "stream"})
    assert (package.copy / "run.sh").read_text() == "#!/bin/rc\n"
    _HASHED.clear()
    assert sync_workspace(small, package.src).files_sent == 0
    held = json.loads((package.copy / MANIFEST).read_text())
    assert held == {rel: list(entry) for rel, entry in manifest(package.src.resolve()).items()}


def test_a_door_nobody_connects_to_closes_empty(tmp_path: Path) -> None:
    door = serve(tmp_path / "copy")
    assert door.close() == 0 and door.listener.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(door.address, timeout=5)


def test_what_a_host_refuses_comes_back_from_its_door(small: ProcMesh, package: Package) -> None:
    """A name the host cannot land (a directory holds it in the copy) fails the sync with the host's reason."""
    sync_workspace(small, package.src)
    (package.copy / "blocked").mkdir()
    (package.copy / "blocked" / "keep").write_text("a directory where the source has a file")
    (package.src / "blocked").write_bytes(os.urandom(1 << 20))
    with pytest.raises(ActorError, match="IsADirectoryError|Is a directory"):
        sync_workspace(small, package.src)
