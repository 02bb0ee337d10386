"""The mpiexec command line and worker environment (no processes started here)."""
from __future__ import annotations

import sys

import pytest

from monarch import config
from monarch.actor import HostMesh, this_host
from monarch.errors import MeshError
from monarch.runtime.control import launch
from monarch.shape import Shape


def test_local_command_uses_the_fork_launcher() -> None:
    cmd = launch.command("/x/mpiexec", Shape.row_major(("dp", "tp"), (2, 2)), ["localhost"], "127.0.0.1:9", 3)
    assert cmd[:5] == ["/x/mpiexec", "-n", "4", "-launcher", "fork"]
    assert cmd[5:8] == [sys.executable, "-m", "monarch.runtime.control.worker"]
    assert "dp=2,tp=2" in cmd and "127.0.0.1:9" in cmd


def test_multi_host_command_spreads_ranks_per_host() -> None:
    shape = Shape.row_major(("hosts", "gpus"), (2, 4))
    cmd = launch.command("mpiexec", shape, ["a", "b"], "10.0.0.1:9", 1)
    assert cmd[:7] == ["mpiexec", "-n", "8", "-hosts", "a,b", "-ppn", "4"]


def test_host_meshes_have_a_hosts_dim() -> None:
    hosts = HostMesh(["a", "b", "c"])
    assert hosts.extent == {"hosts": 3} and hosts.slice(hosts=slice(1, 3)).size() == 2
    assert this_host().extent == {"hosts": 1}
    with pytest.raises(MeshError, match="hosts"):
        this_host().spawn_procs(per_host={"hosts": 2})


def test_worker_env_carries_our_import_path_and_no_token_on_this_host() -> None:
    handover = launch.TokenHandover(b"\x01\x02", 1, local=True)
    env = launch.worker_env({"PYTHONPATH": "/extra", "FOO": "1"}, handover)
    handover.remove()
    assert config.WORKER_TOKEN not in env and env["FOO"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    path = env["PYTHONPATH"].split(":")
    assert path[0] == "/extra" and launch._PACKAGE_ROOT in path
