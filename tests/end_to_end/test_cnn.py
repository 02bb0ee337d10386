"""The zoo's small CNN (Conv2d, BatchNorm2d, ReLU, MaxPool2d, Linear) trained data-parallel over dp=2.

Each rank's convolutions see only its share of the batch (placements, local shapes and the traced
graph say so, and the forward gathers nothing); five SGD steps, eager and under monarch.compile, give
plain torch's losses, parameters and BatchNorm statistics; the same on real worker processes.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import monarch
from monarch import Shard
from monarch.actor import this_host
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import session_of
from monarch.tensor.placement import R
from tests.end_to_end import zoo_runs
from tests.end_to_end.zoo_runs import STEPS, TOL, assert_same_state, conv_inputs, value, zoo

pytestmark = pytest.mark.usefixtures("strict")


def batches(n: int, batch: int = 6) -> list[zoo.Batch]:
    return zoo.images(zoo.Size(batch=batch), n)


def pair(norm: bool, mesh: Any) -> tuple[nn.Module, nn.Module]:
    """A data-parallel model on `mesh` and its untouched plain twin."""
    torch.manual_seed(0)
    ref = zoo.CNN(norm=norm)
    return monarch.data_parallel(copy.deepcopy(ref), mesh), ref


def train(model: nn.Module, data: list[zoo.Batch], compiled: bool = False) -> list[float]:
    return zoo_runs.train(model, zoo.VARIANTS["cnn"], data, compiled)


# -- the batch is really split ----------------------------------------------------------------------
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "batchnorm"])
def test_each_rank_convolves_its_share_of_the_batch(norm: bool) -> None:
    """Batch 5 over dp=2: every convolution input is Shard(0) with 3 and 2 local rows; the traced graph
    shows each convolution on S(0) with a replicated weight; the forward moves nothing but BatchNorm's
    two statistics all_reduces per layer."""
    mesh = LocalMesh({"dp": 2})
    model, ref = pair(norm, mesh)
    seen = conv_inputs(model)
    x = torch.randn(5, 3, 8, 8)
    xs = monarch.distribute_tensor(x, mesh, {"dp": Shard(0)})
    s = session_of(mesh)
    s.flush()
    before = len(s.collectives)
    text = monarch.explain(model, xs)
    assert s.collectives[before:] == ["all_reduce[dp]"] * (4 if norm else 0)
    assert len(seen) == 2
    for t in seen:
        assert t.placements == (Shard(0),)
        assert [t._spec.local_shape((r,))[0] for r in range(2)] == [3, 2]
    convs = re.findall(r"= convolution\(%\w+: ([^,\s]+), %\w+: ([^,)\s]+).*\[(\S+)\]$", text, re.M)
    assert convs == [("S(0)", "R", "S(0)")] * 2, convs
    torch.testing.assert_close(value(model(x)), ref(x), **TOL)


def test_conv_backward_keeps_the_batch_split() -> None:
    """Backward: grad_input stays batch-sharded, weight and bias gradients are Partial sums over dp until
    the optimizer reads them (one all_reduce each)."""
    mesh = LocalMesh({"dp": 2})
    model, ref = pair(False, mesh)
    x, y = batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g.placements == (monarch.Partial("sum"),) for g in grads.values()), {n: g.placements
                                                                                    for n, g in grads.items()}
    F.cross_entropy(ref(x), y).backward()
    for (name, g), p in zip(grads.items(), ref.parameters(), strict=True):
        torch.testing.assert_close(value(g), p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_tensor_parallel_convs() -> None:
    """Batch over dp; over tp the first conv's out-channels (weight and bias) and the second conv's
    in-channels: channels stay sharded through ReLU and MaxPool, the second conv's Partial output is the
    forward's one all_reduce over tp; five steps match plain torch and the shards stay put."""
    mesh = LocalMesh({"dp": 2, "tp": 2})
    torch.manual_seed(0)
    ref = zoo.CNN(norm=False)
    model = copy.deepcopy(ref)
    first, second = model.features[0], model.features[4]
    for module, name, p in ((first, "weight", Shard(0)), (first, "bias", Shard(0)), (second, "weight", Shard(1))):
        plain = getattr(module, name).detach()
        setattr(module, name, nn.Parameter(monarch.distribute_tensor(plain, mesh, {"tp": p})))
    monarch.data_parallel(model, mesh)
    x = batches(1)[0][0]
    s = session_of(mesh)
    s.flush()
    before = len(s.collectives)
    out = model(x)
    s.flush()
    assert s.collectives[before:] == ["all_reduce[tp]"]
    torch.testing.assert_close(value(out), ref(x), **TOL)
    data = batches(STEPS)
    assert train(model, data) == pytest.approx(train(ref, data), **{"rel": 1e-5, "abs": 1e-5})
    assert_same_state(model, ref)
    assert first.weight.placements == (R, Shard(0)) and second.weight.placements == (R, Shard(1))


# -- training matches plain torch -------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "batchnorm"])
def test_training_matches_torch(norm: bool, compiled: bool) -> None:
    model, ref = pair(norm, LocalMesh({"dp": 2}))
    data = batches(STEPS)
    got = train(model, data, compiled)
    want = train(ref, data)
    assert got == pytest.approx(want, **{"rel": 1e-5, "abs": 1e-5})
    assert_same_state(model, ref)


def test_training_on_procs() -> None:
    """The BatchNorm CNN trains on two real worker processes as in plain torch, eager then compiled."""
    with this_host().spawn_procs(per_host={"dp": 2}) as procs:
        for compiled in (False, True):
            model, ref = pair(True, procs)
            data = batches(STEPS, batch=5)
            got = train(model, data, compiled)
            assert got == pytest.approx(train(ref, data), **{"rel": 1e-5, "abs": 1e-5})
            assert_same_state(model, ref)
