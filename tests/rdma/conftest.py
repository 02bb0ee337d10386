"""Meshes of the monarch.rdma tests, shared by each module: two owners and three readers, so a transfer
always crosses processes of two meshes."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from rdma_actors import Owner, Reader

from monarch.actor import ActorMesh, this_host


@pytest.fixture(scope="module")
def owners() -> Iterator[ActorMesh[Owner]]:
    with this_host().spawn_procs(per_host={"gpus": 2}, name="rdma_owners") as procs:
        yield procs.spawn("owner", Owner)


@pytest.fixture(scope="module")
def readers() -> Iterator[ActorMesh[Reader]]:
    with this_host().spawn_procs(per_host={"gpus": 3}, name="rdma_readers") as procs:
        yield procs.spawn("reader", Reader)


@pytest.fixture(params=["shm", "tcp"])
def via(request: pytest.FixtureRequest) -> str:
    """The backend a test's transfers take between processes."""
    return request.param
