"""A user's torch.Generator on a real mesh: every factory and random op given `generator=` gives exactly
the numbers plain torch gives with that generator, inside `procs.activate()` and on existing MeshTensors,
and leaves the generator in the state plain torch leaves it (it draws on the controller and distributes).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import monarch
from monarch import MeshTensor, Replicate, Shard
from monarch.actor import ProcMesh

T = 30.0  # seconds any single wait may take
Dist = Callable[[torch.Tensor, Any], Any]


def draws(g: torch.Generator, dist: Dist) -> list[Any]:
    """A data pipeline's draws; `dist(t, placements)` makes the tensor the later ops run on."""
    out = [torch.randint(0, 64, (8, 17), generator=g), torch.randint(10, (5,), generator=g),
           torch.rand(3, 4, generator=g), torch.randn(2, 3, generator=g, dtype=torch.float64),
           torch.randperm(9, generator=g), torch.normal(0.0, 1.0, (4,), generator=g)]
    x = dist(torch.zeros(6, 4), {"dp": Shard(0)})
    out += [x.uniform_(-2, 2, generator=g).clone(), x.normal_(1.0, 3.0, generator=g).clone(),
            x.t().exponential_(generator=g).clone(), x.clone(), x.bernoulli_(0.3, generator=g).clone()]
    probs = dist(torch.linspace(0, 1, 24).reshape(6, 4), {"tp": Shard(1)})
    weights = dist(torch.arange(1.0, 9.0).reshape(2, 4), [Shard(0), Shard(1)])
    out += [torch.bernoulli(probs, generator=g), torch.multinomial(weights, 3, generator=g),
            torch.normal(probs, 2.0, generator=g), torch.poisson(probs * 4, generator=g)]
    return out


def plain(t: Any) -> torch.Tensor:
    return t.full_tensor(timeout=T) if isinstance(t, MeshTensor) else t


def test_randint_with_a_generator_inside_activate(procs: ProcMesh) -> None:
    with procs.activate():
        x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(7))
    assert torch.equal(plain(x), torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(7)))


def test_generator_draws_match_plain_torch(procs: ProcMesh) -> None:
    g, want = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    expected = draws(want, lambda t, p: t)
    with procs.activate():
        got = draws(g, lambda t, p: monarch.distribute_tensor(t, procs, p))
    assert all(isinstance(t, MeshTensor) and t.mesh is procs for t in got[:4] + got[6:])
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        a = plain(a)
        assert a.dtype == b.dtype and torch.equal(a, b), f"draw {i}: {a} != {b}"
    assert torch.equal(g.get_state(), want.get_state())


def test_monarchs_factories_with_a_generator_keep_their_placements(procs: ProcMesh) -> None:
    g, want = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = monarch.randn(6, 5, mesh=procs, placements={"dp": Shard(0), "tp": Shard(1)}, generator=g)
    y = monarch.randint(-4, 4, (5, 3), mesh=procs, placements={"tp": Shard(0)}, generator=g)
    z = monarch.rand(2, 3, mesh=procs, generator=g, dtype=torch.float64)
    assert x.placements == (Shard(0), Shard(1)) and y.placements == (Replicate(), Shard(0))
    assert torch.equal(plain(x), torch.randn(6, 5, generator=want))
    assert torch.equal(plain(y), torch.randint(-4, 4, (5, 3), generator=want))
    assert torch.equal(plain(z), torch.rand(2, 3, generator=want, dtype=torch.float64))
    assert torch.equal(g.get_state(), want.get_state())


def test_generator_inside_a_compiled_step_is_refused(procs: ProcMesh) -> None:
    g = torch.Generator().manual_seed(0)
    x = monarch.zeros(4, 4, mesh=procs)

    @monarch.compile
    def step(t: MeshTensor) -> MeshTensor:
        return t.uniform_(generator=g) * 2

    with pytest.raises(monarch.TraceError, match="generator=.*monarch.compile"):
        step(x)
