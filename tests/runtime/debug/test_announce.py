"""The admin token is announced where only this user can read it, and nobody else can steer where it goes.

Another local user (`nobody`, through setpriv) who makes the announce directory first, with a
world-writable announcement file in it, gets a refusal instead of the token; so do a directory open to
others and a link in the directory's place. A link in the announcement file's place is replaced, never
written through, and announcements that are not the user's own 0600 files are ignored by `monarch query`.
The runtime directory (`$XDG_RUNTIME_DIR`) is preferred to the temp dir. Needs root to act as another user.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch.runtime.debug import admin

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
NOBODY = 65534


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp dir like /tmp (sticky, anyone may create in it) as the only place to announce."""
    shared = Path(tempfile.mkdtemp(prefix="monarch-announce-test-", dir="/tmp"))  # reachable by nobody
    shared.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(admin, "RUNTIME_ROOT", str(tmp_path / "no-runtime"), raising=False)
    try:
        yield shared
    finally:
        shutil.rmtree(shared)


def as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd], check=True,
                   timeout=30)


def server() -> admin.AdminServer:
    return admin.AdminServer(lambda sql, wait: None)  # type: ignore[arg-type,return-value]


def test_a_directory_another_user_made_first_is_refused(tmp: Path) -> None:
    squatted = tmp / f"monarch-{os.geteuid()}"
    planted = squatted / f"controller-{os.getpid()}.json"
    as_nobody("mkdir", "-m", "0777", str(squatted))
    as_nobody("sh", "-c", f"echo '{{}}' > {planted} && chmod 0666 {planted}")
    with pytest.raises(admin.UnsafeAnnounceDir, match=f"owned by uid {NOBODY}.*XDG_RUNTIME_DIR"):
        server()
    assert planted.read_text() == "{}\n"  # no token went there


@pytest.mark.parametrize("kind", ["open", "link"])
def test_a_directory_open_to_others_or_a_link_is_refused(tmp: Path, tmp_path: Path, kind: str) -> None:
    path = tmp / f"monarch-{os.geteuid()}"
    if kind == "open":
        path.mkdir()
        path.chmod(0o755)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(admin.UnsafeAnnounceDir, match="open to others" if kind == "open" else "symbolic link"):
        server()
    assert not list((tmp_path / "elsewhere").iterdir()) if kind == "link" else True


def test_a_link_in_the_files_place_is_replaced_not_followed(tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = admin.announce_dir()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.parent == tmp
    (d / f"controller-{os.getpid()}.json").symlink_to(victim)
    s = server()
    try:
        assert victim.read_text() == "keep"
        st = os.lstat(s.path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert json.loads(s.path.read_text())["port"] == s.port
        assert [c["pid"] for c in admin.controllers()] == [os.getpid()]
    finally:
        s.close()


def test_announcements_that_are_not_the_users_own_are_ignored(tmp: Path) -> None:
    d = admin.announce_dir()
    fake = d / "controller-1.json"  # pid 1 is alive: only the file's owner and mode can tell
    fake.write_text(json.dumps({"pid": 1, "port": 1, "token": "00"}))
    fake.chmod(0o644)
    assert admin.controllers() == []
    os.chown(fake, NOBODY, NOBODY)
    fake.chmod(0o600)
    assert admin.controllers() == []


def test_the_runtime_directory_is_preferred(tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert admin.announce_dir() == runtime / f"monarch-{os.geteuid()}"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr(admin, "RUNTIME_ROOT", str(tmp_path))
    (tmp_path / str(os.geteuid())).mkdir(mode=0o700)
    assert admin.announce_dir() == tmp_path / str(os.geteuid()) / f"monarch-{os.geteuid()}"
