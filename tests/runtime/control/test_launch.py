"""The mpiexec command line and worker environment (no processes started here)."""
from __future__ import annotations

import sys

import pytest

from monarch.actor import HostMesh, this_host
from monarch.cluster.ssh import SshLauncher
from monarch.errors import MeshError
from monarch.runtime.control import launch
from monarch.shape import Shape


def test_local_command_uses_the_fork_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_MPIEXEC", sys.executable)  # any executable file stands for mpiexec here
    shape = Shape.row_major(("dp", "tp"), (2, 2))
    cmd = launch.LocalLauncher().command(shape, launch.worker_command(shape, "127.0.0.1:9", 3), "127.0.0.1")
    assert cmd[:7] == [sys.executable, "-n", "4", "-launcher", "fork", "-iface", "lo"]
    assert cmd[7:10] == [sys.executable, "-m", "monarch.runtime.worker"]
    assert "dp=2,tp=2" in cmd and "127.0.0.1:9" in cmd


def test_multi_host_command_spreads_ranks_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_MPIEXEC", sys.executable)
    monkeypatch.setenv("MONARCH_SSH", "ssh -F /some/config")
    shape = Shape.row_major(("hosts", "gpus"), (2, 4))
    hosts = ["127.0.0.2", "127.0.0.3"]
    cmd = SshLauncher(hosts).command(shape, launch.worker_command(shape, "10.0.0.1:9", 1), "127.0.0.1")
    assert cmd[:9] == [sys.executable, "-n", "8", "-hosts", ",".join(hosts), "-ppn", "4", "-launcher", "ssh"]
    wrapper = cmd[cmd.index("-launcher-exec") + 1]
    assert "exec ssh -F /some/config \"$@\"" in open(wrapper).read()
    assert cmd[cmd.index("-iface") + 1] == "lo"  # the interface of the route to the hosts


@pytest.mark.parametrize("bind, advertise, expect", [
    (None, "", ("127.0.0.1", "127.0.0.1")),  # a mesh on this host: loopback
    ("0.0.0.0", "", ("0.0.0.0", "127.0.0.1")),  # a wildcard is never advertised: the route's address is
    ("10.1.2.3", "", ("10.1.2.3", "10.1.2.3")),
    ("0.0.0.0", "10.9.9.9", ("0.0.0.0", "10.9.9.9")),  # MONARCH_ADVERTISE wins
])
def test_bind_and_advertised_addresses_are_separate(monkeypatch: pytest.MonkeyPatch, bind: str | None,
                                                    advertise: str, expect: tuple[str, str]) -> None:
    monkeypatch.setenv("MONARCH_ADVERTISE", advertise)
    monkeypatch.delenv("MONARCH_HOST", raising=False)
    assert launch.addresses(launch.LocalLauncher(), bind) == expect


def test_remote_meshes_advertise_the_route_to_their_first_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MONARCH_HOST", raising=False)
    monkeypatch.delenv("MONARCH_ADVERTISE", raising=False)
    assert launch.addresses(SshLauncher(["127.0.0.5", "b"]), None) == ("127.0.0.1", "127.0.0.1")


def test_host_meshes_have_a_hosts_dim() -> None:
    hosts = HostMesh(["a", "b", "c"])
    assert hosts.extent == {"hosts": 3} and hosts.slice(hosts=slice(1, 3)).size() == 2
    assert type(hosts._launcher) is SshLauncher and type(hosts.slice(hosts=0)) is HostMesh  # the user-facing class
    assert type(this_host()._launcher) is launch.LocalLauncher
    assert this_host().extent == {"hosts": 1}
    with pytest.raises(MeshError, match="hosts"):  # per_host may name any dim but the one several hosts add
        hosts.spawn_procs(per_host={"hosts": 2})


def test_worker_env_carries_our_import_path() -> None:
    env = launch.worker_env({"PYTHONPATH": "/extra", "FOO": "1"})
    assert env["FOO"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    path = env["PYTHONPATH"].split(":")
    assert path[0] == "/extra" and launch._PACKAGE_ROOT in path
