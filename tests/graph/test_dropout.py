"""Dropout under monarch.manual_seed on a real mesh: the same seed gives the same mask, output and
gradient on every placement and mesh shape (the mask is drawn as pieces of one global tensor, as
rand_like is), another seed another mask, the kept fraction is about 1 - p, and a compiled step
draws a new mask each call, reproducibly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_tuples

import monarch
from monarch import MeshTensor, Partial, Shard
from monarch.actor import ProcMesh
from monarch.tensor.placement import R

T = 30.0  # seconds any single wait may take

DROPOUTS: dict[str, Callable[[Any, float], Any]] = {
    "F.dropout": lambda x, p: F.dropout(x, p),
    "nn.Dropout": lambda x, p: torch.nn.Dropout(p).train()(x),
    "dropout_": lambda x, p: F.dropout(x * 1, p, inplace=True),
    "native_dropout": lambda x, p: torch.native_dropout(x, p, True)[0],
    "F.dropout1d": lambda x, p: F.dropout1d(x, p),
    "F.dropout2d": lambda x, p: F.dropout2d(x[:, :, None, None], p).flatten(1),
    "F.dropout3d": lambda x, p: F.dropout3d(x[:, :, None, None, None], p).flatten(1),
    "F.alpha_dropout": lambda x, p: F.alpha_dropout(x, p, True),
    "F.feature_alpha_dropout": lambda x, p: F.feature_alpha_dropout(x.unsqueeze(-1), p, True).squeeze(-1),
}
VIEWS: dict[str, Callable[[ProcMesh], Any]] = {
    "dp x tp": lambda m: m, "tp": lambda m: m.slice(dp=0), "one rank": lambda m: m.slice(dp=1, tp=0),
}


def run(mesh: Any, placements: tuple, fn: str, p: float, seed: int, data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output and input gradient of dropout of `data` placed as `placements`, after manual_seed(seed)."""
    monarch.manual_seed(seed)
    x = monarch.distribute_tensor(data, mesh, placements).requires_grad_()
    y = DROPOUTS[fn](x, p)
    y.backward(monarch.distribute_tensor(torch.ones(data.shape), mesh))
    return y.full_tensor(timeout=T), x.grad.full_tensor(timeout=T)


DATA = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) + 3  # no zeros: y == 0 marks a drop
WIDE = torch.randn(64, 5, generator=torch.Generator().manual_seed(1)) + 3  # 64 channels: two seeds' masks differ


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_same_seed_same_mask_on_every_placement_and_mesh(procs: ProcMesh, data: st.DataObject) -> None:
    fn = data.draw(st.sampled_from(sorted(DROPOUTS)))
    view = VIEWS[data.draw(st.sampled_from(sorted(VIEWS)))](procs)
    placements = data.draw(placement_tuples(DATA.ndim, len(view.extent)))
    p, seed = data.draw(st.sampled_from([0.2, 0.5, 0.9])), data.draw(st.integers(0, 2**31))
    want = run(procs, (R, R), fn, p, seed, DATA)
    got = run(view, placements, fn, p, seed, DATA)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    one, other = (run(view, placements, fn, p, s, WIDE)[0] for s in (seed, seed + 1))
    assert not torch.equal(one, other)


@pytest.mark.parametrize("fn", ["F.dropout", "native_dropout"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_kept_fraction_and_scale(procs: ProcMesh, fn: str, p: float) -> None:
    data = torch.ones(64, 64)
    y, grad = run(procs, (Shard(0), Shard(1)), fn, p, 11, data)
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.06
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    torch.testing.assert_close(grad, y)  # the backward applies the same mask and scale
    assert len({tuple(r) for r in kept.tolist()}) > 32  # rows differ: no piece repeats another's mask


def test_partial_input_keeps_its_reduction(procs: ProcMesh) -> None:
    got = run(procs, (Partial("sum"), Shard(0)), "F.dropout", 0.5, 3, DATA)
    torch.testing.assert_close(got[0], run(procs, (R, R), "F.dropout", 0.5, 3, DATA)[0], rtol=0, atol=1e-6)


def test_compiled_step_draws_a_new_mask_each_call_reproducibly(procs: ProcMesh) -> None:
    def masks(placements: Any) -> list[torch.Tensor]:
        x = monarch.distribute_tensor(DATA, procs, placements)

        @monarch.compile
        def step(t: MeshTensor) -> MeshTensor:
            return F.dropout(t, 0.5)
        monarch.manual_seed(21)
        return [step(x).full_tensor(timeout=T) != 0 for _ in range(3)]
    first, again = masks({"dp": Shard(0)}), masks({"tp": Shard(1)})
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
