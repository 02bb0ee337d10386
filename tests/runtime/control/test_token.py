"""The mesh token reaches workers through one 0600 file per rank that the worker deletes at start, never
through the environment: no process of the job (mpiexec, its proxy, monitors, workers) has it in
/proc/<pid>/environ, and no token file is left once the mesh has settled or failed to spawn. The script
that writes the files on other hosts runs here under a real sh (the cluster tier runs it over ssh/srun)."""
from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from monarch.actor import Actor, endpoint, this_host
from monarch.errors import SpawnError
from monarch.runtime.control import bootstrap, launch

T = 30


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier and p not in found]
        found.update(kids)
        frontier = kids
    return found


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Token directories go under this test's own temp dir (tempfile.tempdir), so that meshes of other
    processes cannot be mistaken for leftovers of this one."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_no_process_of_the_job_has_the_token_in_its_environment(private_tmp: Path) -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}, name="secret") as procs:
        echo = procs.spawn("echo", Echo)
        assert echo.echo.call(3).get(timeout=T).values() == [3, 3]
        token = procs._mesh.token.hex().encode()
        job = _descendants(procs._mesh.proc.pid)
        assert set(procs.pids) <= job and len(job) >= 5  # mpiexec, its proxy, 2 monitors, 2 workers
        for pid in job:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert token not in environ and token not in cmdline, pid
        args = Path(f"/proc/{procs.pids[0]}/cmdline").read_bytes().decode().split("\0")
        token_dir = Path(args[args.index("--token-dir") + 1])
        assert token_dir.parent == private_tmp and not token_dir.exists()  # each worker took its file, then
        assert not list(private_tmp.glob("monarch-token-*"))               # the controller removed the directory
        assert echo.echo.call(4).get(timeout=T).values() == [4, 4]


def test_token_files_are_removed_when_the_spawn_fails(private_tmp: Path) -> None:
    broken = private_tmp / "path" / "mpi4py"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("simulated broken mpi4py install")\n')
    with pytest.raises(SpawnError, match="simulated broken mpi4py"):
        this_host().spawn_procs(per_host={"gpus": 2}, env={"PYTHONPATH": str(private_tmp / "path")})
    assert not list(private_tmp.glob("monarch-token-*"))


def test_handover_files_are_private_and_taken_once(private_tmp: Path) -> None:
    handover = launch.TokenHandover(b"\x07" * 32, 3, launch.LocalLauncher())
    assert handover.args == ["--token-dir", handover.dir]
    assert stat.S_IMODE(os.stat(handover.dir).st_mode) == 0o700
    files = sorted(Path(handover.dir).iterdir())
    assert [f.name for f in files] == ["rank-0", "rank-1", "rank-2"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert bootstrap.take_token(str(files[1])) == b"\x07" * 32 and not files[1].exists()
    with pytest.raises(SystemExit, match="cannot take the mesh token"):
        bootstrap.take_token(str(files[1]))
    handover.remove()
    assert not Path(handover.dir).exists()


def test_the_script_for_other_hosts_writes_private_files_from_stdin(tmp_path: Path) -> None:
    directory = tmp_path / "monarch-token-x"
    script = launch.token_script(str(directory), "2 3")
    assert "feed" not in script  # the token travels on stdin, not on any command line
    done = subprocess.run(["sh", "-c", script], input="feed" * 16, text=True, capture_output=True, timeout=T)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = sorted(directory.iterdir())
    assert [f.name for f in files] == ["rank-2", "rank-3"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text() == "feed" * 16 for f in files)
    assert bootstrap.take_token(str(files[0])) == bytes.fromhex("feed" * 16) and directory.exists()
    bootstrap.take_token(str(files[1]))
    assert not directory.exists()  # the last rank of the host removed the directory


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_the_script_refuses_a_directory_of_someone_else(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    done = subprocess.run(["sh", "-c", launch.token_script(str(theirs), "0")], input="ab", text=True,
                          capture_output=True, timeout=T)
    assert done.returncode != 0 and not (theirs / "rank-0").exists()
