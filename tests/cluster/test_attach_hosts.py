"""Attach mode on the test hosts: agents started by hand inside two hosts (`python -m monarch worker
--listen tcp://0.0.0.0:26600`, as a Kubernetes pod runs it), a controller attaching by host name, a mesh
across them (ranks on their hosts, actors, a sharded op equal to torch, bytes across the veths), and
nothing left on the hosts once it detached."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from testbed import Testbed, wait_port

import monarch
from monarch import Replicate, Shard
from monarch.actor import Actor, attach_to_workers, endpoint
from monarch.cluster.attach import detach
from monarch.cluster.k8s import DEFAULT_PORT

T = 60


class Where(Actor):
    @endpoint
    def where(self) -> str:
        return socket.gethostname()


@pytest.fixture
def agents(testbed: Testbed) -> Iterator[tuple[list[str], str]]:
    secret = secrets.token_hex(16)
    procs = [subprocess.Popen(["nsenter", f"--net=/run/netns/{h}", "unshare", "--uts", "sh", "-c",
                               f"hostname {h} && exec {sys.executable} -m monarch worker --listen "
                               f"tcp://0.0.0.0:{DEFAULT_PORT}"], env=dict(os.environ, MONARCH_ATTACH_SECRET=secret),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for h in ("mh1", "mh2")]
    try:
        for h in ("mh1", "mh2"):
            wait_port(testbed.address(h), DEFAULT_PORT)
        yield [f"tcp://{h}:{DEFAULT_PORT}" for h in ("mh1", "mh2")], secret
    finally:
        detach()
        for p in procs:
            p.terminate()
            p.wait(timeout=T)


def test_attach_to_agents_on_two_hosts(testbed: Testbed, agents: tuple[list[str], str]) -> None:
    others = testbed.all_pids()
    workers, secret = agents
    hosts = attach_to_workers(workers=workers, secret=secret)
    with hosts.spawn_procs(per_host={"gpus": 2}, name="attached") as procs:
        assert procs.spawn("w", Where).where.call().get(timeout=T).values() == ["mh1", "mh1", "mh2", "mh2"]
        x = torch.randn(256, 64)
        before = testbed.veth_bytes()
        m = monarch.distribute_tensor(x, procs, [Shard(0), Replicate()])
        torch.testing.assert_close((m * 2).sum(0).full_tensor(), (x * 2).sum(0), rtol=1e-4, atol=1e-4)
        assert testbed.veth_bytes() - before > x.numel() * 4 // 2
    procs = hosts.spawn_procs(per_host={"gpus": 1}, name="again")  # the agents serve a second mesh
    assert procs.spawn("w", Where).where.call().get(timeout=T).values() == ["mh1", "mh2"]
    hosts.shutdown()  # stops the mesh and lets the agents go
    assert not procs.running
    assert not testbed.strays(others), testbed.strays(others)
    again = attach_to_workers(workers=workers, secret=secret)  # they wait for the next controller
    with again.spawn_procs(per_host={"gpus": 1}, name="third") as procs:
        assert procs.spawn("w", Where).where.call().get(timeout=T).values() == ["mh1", "mh2"]


def test_a_wrong_secret_is_refused_by_the_agents(agents: tuple[list[str], str]) -> None:
    workers, _ = agents
    with pytest.raises(monarch.SpawnError, match="mh1"):
        attach_to_workers(workers=workers, secret="not-the-secret", timeout=10)
