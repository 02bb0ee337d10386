"""The data plane between test hosts: RDMABuffer transfers over the owners' TCP doors across the veths (the test
hosts share a kernel, so cross-memory attach would reach them: the ranks are told MONARCH_RDMA_BACKEND=tcp, as
hosts without RDMA devices and without a shared kernel would choose), between ranks of two hosts and with the
controller, and `to_mesh` between a mesh on one host and a mesh on the other.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from testbed import Testbed

import monarch
from monarch import Shard
from monarch.actor import Actor, HostMesh, ProcMesh, endpoint
from monarch.rdma import RDMABuffer

T = 60.0
TCP = {"MONARCH_RDMA_BACKEND": "tcp"}


class Holder(Actor):
    @endpoint
    def share(self, n: int) -> RDMABuffer:
        self.data = torch.arange(n, dtype=torch.int32)
        return RDMABuffer(self.data.view(torch.uint8))

    @endpoint
    def read(self, buf: RDMABuffer) -> tuple[str, str, torch.Tensor]:
        out = torch.empty(buf.size(), dtype=torch.uint8)
        buf.read_into(out).get(timeout=T)
        return socket.gethostname(), buf.backend, out.view(torch.int32)

    @endpoint
    def total(self) -> int:
        return int(self.data.sum())


@pytest.fixture(scope="module")
def two_hosts(testbed: Testbed) -> Iterator[tuple[ProcMesh, ProcMesh]]:
    with HostMesh(["mh1"]).spawn_procs(per_host={"g": 1}, env=TCP) as one, \
            HostMesh(["mh2"]).spawn_procs(per_host={"g": 1}, env=TCP) as two:
        yield one, two
    assert not testbed.strays(), testbed.strays()


def test_a_rank_reads_a_buffer_of_another_host(two_hosts: tuple[ProcMesh, ProcMesh]) -> None:
    one, two = two_hosts
    buf = one.spawn("holder", Holder).share.call_one(3 << 20).get(timeout=T)  # 12 MiB on mh1
    host, backend, got = two.spawn("reader", Holder).read.call_one(buf).get(timeout=T)
    assert (host, backend) == ("mh2", "tcp")
    assert torch.equal(got, torch.arange(3 << 20, dtype=torch.int32))
    assert buf.owner.startswith("rank 0 of mesh")


def test_the_controller_reads_and_writes_a_far_rank(
        two_hosts: tuple[ProcMesh, ProcMesh], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_RDMA_BACKEND", "tcp")
    _, two = two_hosts
    holder = two.spawn("far", Holder)
    buf = holder.share.call_one(1000).get(timeout=T)
    out = torch.empty(1000, dtype=torch.int32)
    buf.read_into(out.view(torch.uint8)).get(timeout=T)
    assert torch.equal(out, torch.arange(1000, dtype=torch.int32))
    buf.write_from(torch.ones(1000, dtype=torch.int32).view(torch.uint8)).get(timeout=T)
    assert holder.total.call_one().get(timeout=T) == 1000


def test_to_mesh_crosses_hosts(two_hosts: tuple[ProcMesh, ProcMesh]) -> None:
    one, two = two_hosts
    x = torch.randn(64, 1024)
    moved = monarch.distribute_tensor(x, one, {"g": Shard(0)}).to_mesh(two, {"g": Shard(1)})
    assert moved.mesh is two and torch.equal(moved.full_tensor(timeout=T), x)
