"""The model zoo (examples/zoo.py: TransformerEncoder, LLaMA block, ResNet, GPT) trains sharded as in plain torch.

Five SGD steps on dp=2, tp=2 (models with a plan) and dp=2 x tp=2, eager and compiled, give plain torch's
losses, parameters and buffers to 1e-5, with every op covered by a sharding rule (MONARCH_STRICT=1); each
model also once compiled on real worker processes. The ResNet's convolutions see their share of the batch,
and the fallback counter counts an op that has no rule.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import monarch
from monarch import Shard
from monarch.actor import ProcMesh
from monarch.graph import decompose, propagate
from monarch.graph.rules.table import RULES
from monarch.runtime.session.local import LocalMesh
from tests.end_to_end.zoo_runs import check_same, conv_inputs, parallelize, train, zoo

MESHES = {"dp": {"dp": 2}, "tp": {"tp": 2}, "dpxtp": {"dp": 2, "tp": 2}}
CASES = [pytest.param(name, mesh, id=f"{name}-{mesh}") for name, entry in zoo.ZOO.items() for mesh in MESHES
         if mesh != "tp" or entry.plan is not None]


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name,mesh", CASES)
def test_training_matches_torch(name: str, mesh: str, compiled: bool) -> None:
    check_same(zoo.ZOO[name], LocalMesh(MESHES[mesh]), compiled)


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_training_on_procs(procs: ProcMesh, name: str) -> None:
    """On the dp=2 x tp=2 worker processes, compiled (the ResNet replicated over tp: it has no plan)."""
    check_same(zoo.ZOO[name], procs, compiled=True)


def test_only_linear_styles_exist_for_the_resnet() -> None:
    """The ResNet has no plan because the styles shard nn.Linear and nn.Embedding only."""
    with pytest.raises(monarch.ShardingError, match="cannot shard module 'stem.0'"):
        monarch.parallelize_module(zoo.ResNet(zoo.Size()), LocalMesh({"tp": 2}), {"stem.0": monarch.ColwiseParallel()})


@pytest.mark.usefixtures("strict")
def test_resnet_convolutions_see_their_share_of_the_batch() -> None:
    """Batch 5 over dp=2, one eager training step: every Conv2d input (stem, blocks, downsample) is
    Shard(0) with 3 and 2 local samples, in the forward of the step."""
    entry, size = zoo.ZOO["resnet"], zoo.Size(batch=5)
    torch.manual_seed(0)
    model = parallelize(entry.build(size), LocalMesh({"dp": 2}), entry, size)
    seen = conv_inputs(model)
    train(model, entry, entry.data(size, 1, 1))
    assert len(seen) == 6
    for t in seen:
        assert t.placements == (Shard(0),)
        assert [t._spec.local_shape((r,))[0] for r in range(2)] == [3, 2]


def test_fallback_counts_ops_without_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op without a rule (mm's, removed here) runs replicated and is counted once per decision."""
    monkeypatch.delitem(RULES, torch.ops.aten.mm.default)
    monkeypatch.setattr(decompose, "_verdicts", {})
    mesh = LocalMesh({"dp": 2})
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    before = propagate.fallback_counts().get("mm", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = monarch.distribute_tensor(a, mesh, {"dp": Shard(0)}) @ monarch.distribute_tensor(b, mesh, {})
    assert propagate.fallback_counts().get("mm", 0) == before + 1
    torch.testing.assert_close(got.full_tensor(timeout=60.0), a @ b)
    counts = propagate.fallback_counts()
    counts["mm"] = -1  # a copy: the module's own counts stay as they are
    assert propagate.fallback_counts()["mm"] == before + 1
