"""Weight-update sharding (MONARCH_SHARD_UPDATE) on real worker processes: dp=2 with SGD, Adam and AdamW, dp=4,
and dp=2 x tp=2. Parameters and optimizer state equal an unsharded update's; each step runs one reduce_scatter
and one all_gather bucket on the workers; the state each rank keeps is its slice."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from monarch.actor import this_host
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.telemetry.events import now_us
from tests.runtime.session.test_shard_update import OPTIMIZERS, STEPS, assert_same_training, sharded_state, train


SHAPES = {"dp2": {"dp": 2}, "dp4": {"dp": 4}, "dp2xtp2": {"dp": 2, "tp": 2}}
CASES = [*(("dp2", name) for name in OPTIMIZERS), ("dp4", "adam"), ("dp4", "adamw"), ("dp2xtp2", "adamw")]


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest) -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host=SHAPES[request.param]) as procs:
        yield procs


@pytest.mark.parametrize("mesh,optimizer", CASES, indirect=["mesh"])
def test_sharded_updates_equal_unsharded_ones(mesh: ProcMesh, optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    since = now_us()
    on = train(mesh, optimizer, "on", monkeypatch)
    kinds = dict(mesh.sql("SELECT kind, count(*) FROM collectives WHERE rank = 0 AND mdim = 0 AND start_us >= "
                          f"{since} GROUP BY kind"))  # over dp
    assert kinds["reduce_scatter (bucket)"] == STEPS and kinds["all_gather (bucket)"] == STEPS, kinds
    if "tp" not in mesh.extent:  # and the loss fetched
        assert kinds == {"reduce_scatter (bucket)": STEPS, "all_gather (bucket)": STEPS, "all_reduce": STEPS}, kinds
    assert_same_training(on, train(mesh, optimizer, "off", monkeypatch))
    assert sharded_state(on[1], 0)
