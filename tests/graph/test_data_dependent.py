"""Ops whose output shape or result depends on the values (tensor/data_dependent.py), in strict mode: nonzero,
argwhere, masked_select, x[mask], unique and unique_consecutive (flat and over a dim; inverse, counts),
bincount, repeat_interleave, histc, histogram and histogramdd (range, weight, density, bin tensors), take,
bucketize, equal and allclose on randomly placed inputs (uneven, empty and Partial pieces, all-zero and
empty tensors) equal plain torch exactly; counts are added on the ranks (one all_reduce, no gather); wrong
masks and inputs fail as plain torch does; writes through a mask (index_put) and the gradient of a masked
read are exact on Partial pieces too; a monarch.compile'd step says why it cannot; a real mesh too.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, tensor_shapes
from test_rules_view import MESHES, check
from torch.utils._pytree import tree_leaves

import monarch
from monarch.actor import ProcMesh
from monarch.runtime.session.local import LocalMesh
from monarch.tensor import Partial, Replicate, Shard

pytestmark = pytest.mark.usefixtures("strict")
R, P, S0 = Replicate(), Partial("sum"), Shard(0)


def points(x: torch.Tensor) -> torch.Tensor:
    """x as points (..., N) for histogramdd: a 1-d x as points of one coordinate."""
    return x if x.ndim > 1 else x.unsqueeze(-1)


ONE: dict[str, Callable[[Any], Any]] = {  # functions of one tensor with few distinct values
    "nonzero": torch.nonzero,
    "argwhere": torch.argwhere,
    "where(cond)": lambda x: torch.where(x > 0),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "masked_select broadcast": lambda x: torch.masked_select(x, x[..., :1] > 0),
    "x[mask]": lambda x: x[x > 0],
    "x[mask] leading dim": lambda x: x[x.flatten(1).sum(1) > 1] if x.ndim > 1 else x[x > 1],
    "x[:, mask]": lambda x: x[:, x[0] > 0] if x.ndim > 1 else x[x > 0],
    "x[plain mask]": lambda x: x[torch.arange(x.shape[0]) % 2 == 0],
    "unique": torch.unique,
    "unique all": lambda x: torch.unique(x, return_inverse=True, return_counts=True),
    "unique int": lambda x: torch.unique(x.long(), return_inverse=True),
    "Tensor.unique": lambda x: x.unique(return_counts=True),
    "unique dim": lambda x: torch.unique(x, dim=0, return_inverse=True, return_counts=True),
    "unique_consecutive": lambda x: torch.unique_consecutive(x, return_inverse=True, return_counts=True),
    "unique_consecutive dim": lambda x: torch.unique_consecutive(x, dim=0, return_counts=True),
    "bincount": lambda x: torch.bincount(x.flatten().long()),
    "bincount weights minlength": lambda x: torch.bincount(x.flatten().long(), x.flatten() * 0.5, minlength=6),
    "histc range": lambda x: torch.histc(x, 5, 0, 3),
    "histc data range": lambda x: torch.histc(x, 4),
    "histogram": lambda x: torch.histogram(x, 4),
    "histogram range weight": lambda x: torch.histogram(x, 3, range=(0.0, 2.0), weight=x + 1),
    "histogram density": lambda x: torch.histogram(x, 4, density=True),
    "histogram bins": lambda x: torch.histogram(x, torch.tensor([0.0, 0.5, 1.0, 2.5]), weight=x + 1, density=True),
    "histogramdd": lambda x: torch.histogramdd(points(x), [3] * points(x).shape[-1]),
    "histogramdd range density": lambda x: torch.histogramdd(
        points(x), [2] * points(x).shape[-1], range=[0.0, 2.0] * points(x).shape[-1], weight=points(x).sum(-1) + 1,
        density=True),
    "unique dim last": lambda x: torch.unique(x, dim=-1, return_inverse=True),
    "repeat_interleave": lambda x: torch.repeat_interleave(x.flatten().long()),
    "repeat_interleave dim": lambda x: x.repeat_interleave((x.flatten(1).sum(1) if x.ndim > 1 else x).long(), dim=0),
    "take": lambda x: torch.take(x, (x.long() * 7 + 3) % max(x.numel(), 1)),
    "bucketize": lambda x: torch.bucketize(x, torch.tensor([0.5, 1.0, 1.5]), right=True),
}


def few_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values in {0, 1, 2}: zeros to skip and repeats to merge."""
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_equal_to_plain_torch_on_every_placement(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(ONE)))
    shape = data.draw(tensor_shapes(1, 3, max_size=5))
    x = few_values(shape, data.draw(st.integers(0, 99)))
    if data.draw(st.booleans()) and name not in ("x[plain mask]",):
        x = x * data.draw(st.sampled_from([0, 1]))  # all zeros half of these times
    dims = data.draw(st.sampled_from(MESHES))
    check(ONE[name], dims, (x, data.draw(placement_tuples(x.ndim, len(dims)))))


@pytest.mark.parametrize("name", ["nonzero", "masked_select", "x[mask]", "unique all", "bincount", "histc range",
                                  "unique dim", "histogram"])
def test_empty_tensor(name: str) -> None:
    check(ONE[name], {"x": 2}, (torch.zeros(0, 3), (S0,)))


@pytest.mark.parametrize("fn", [lambda x: torch.histc(x, 5, 0, 3), lambda x: torch.bincount(x.flatten().long()),
                                lambda x: torch.histogram(x, 4).hist, lambda x: torch.histogram(x, 3, weight=x).hist,
                                lambda x: torch.histogramdd(x, [2, 3, 2]).hist])
def test_counts_are_added_on_the_ranks_not_gathered(fn: Callable[[Any], Any]) -> None:
    """Each rank counts its piece into a Partial result; only small all_reduces move (bincount's length
    and the histograms' edges come from the max and min of the pieces), never the data."""
    x = few_values((8, 3), 1)
    mesh = LocalMesh({"x": 2})
    s = mesh.session
    y = fn(monarch.distribute_tensor(x, mesh, [S0]))
    assert y.placements == (P,)
    assert torch.equal(y.full_tensor(), fn(x))
    assert s.collectives and set(s.collectives) == {"all_reduce[x]"}, s.collectives


@pytest.mark.parametrize("placements", [(S0, Shard(1)), (P, R), (R, P), (Shard(1), P)])
def test_writes_through_a_mask_and_the_gradient_of_a_masked_read(placements: tuple) -> None:
    base = torch.arange(20.0).reshape(4, 5)
    mesh = LocalMesh({"a": 2, "b": 2})

    def put(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t[t > 7] = -1.0
        return t.index_put_((torch.tensor([0, 2, 0]),), v, accumulate=True)
    x = put(monarch.distribute_tensor(base, mesh, list(placements)),
            monarch.distribute_tensor(torch.ones(3, 5), mesh, [P, R]))
    assert torch.equal(x.full_tensor(), put(base.clone(), torch.ones(3, 5)))
    x = monarch.distribute_tensor(base, mesh, list(placements)).requires_grad_()
    x[x > 7].pow(2).sum().backward()
    plain = base.clone().requires_grad_()
    plain[plain > 7].pow(2).sum().backward()
    assert torch.equal(x.grad.full_tensor(), plain.grad)


PAIRS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # a second tensor, equal or close or neither
    "same": torch.clone, "one differs": lambda x: x + (x == x.max()).float(), "close": lambda x: x + 1e-7,
    "nan": lambda x: x.masked_fill(x == x.max(), float("nan")), "broadcast row": lambda x: x[:1].clone(),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("placements", [((S0, Shard(1)), (R, S0)), ((P, R), (Shard(1), P)), ((S0, S0), (S0, S0))])
def test_equal_and_allclose_read_one_flag(name: str, placements: tuple) -> None:
    """Each rank compares its pieces (after aligning the placements); one flag is all_reduced per mesh dim."""
    x = few_values((5, 3), 2)
    y = PAIRS[name](x)
    mesh = LocalMesh({"a": 2, "b": 2})
    a, b = (monarch.distribute_tensor(t, mesh, list(p)) for t, p in zip((x, y), placements, strict=True))
    s = mesh.session
    aligned = placements[0] == placements[1] and x.shape == y.shape
    calls = [(torch.equal, {}), (torch.allclose, {}), (torch.allclose, {"atol": 1e-6, "equal_nan": True})]
    for fn, kwargs in calls:
        s.flush()
        before = len(s.collectives)
        assert fn(a, b, **kwargs) is fn(x, y, **kwargs), (fn, kwargs)
        if aligned:
            assert sorted(s.collectives[before:]) == ["all_reduce[a]", "all_reduce[b]"], s.collectives[before:]
    with pytest.raises(monarch.ShapeError, match="did not match"):
        torch.allclose(a, b.long())


def test_wrong_inputs_fail_as_in_plain_torch() -> None:
    x = monarch.distribute_tensor(torch.arange(6.0).reshape(2, 3), LocalMesh({"x": 2}), [S0])
    with pytest.raises(monarch.ShapeError, match="shape of the mask"):
        x[x[0] > 0]
    with pytest.raises(monarch.ShapeError, match="non-negative"):
        torch.bincount(x.flatten().long() - 3)
    with pytest.raises(monarch.ShapeError, match="1-d"):
        torch.bincount(x.long())
    with pytest.raises(monarch.ShapeError, match="negative"):
        torch.repeat_interleave(x.flatten().long() - 3)
    with pytest.raises(monarch.ShapeError, match="not finite"):
        torch.histogram(x / 0.0, 3)
    with pytest.raises(monarch.ShapeError, match="aren't selected"):
        torch.unique(x[:, :0], dim=0)


def test_a_compiled_step_says_why_it_cannot() -> None:
    x = monarch.distribute_tensor(torch.arange(6.0), LocalMesh({"x": 2}), [S0])
    for fn in (torch.nonzero, torch.unique, lambda t: torch.histogram(t, 3).hist,
               lambda t: torch.repeat_interleave(t.long()), lambda t: torch.unique(t, dim=0)):
        with pytest.raises(monarch.TraceError, match="depends on the values"):
            monarch.compile(fn)(x)


def test_on_a_real_mesh(procs: ProcMesh) -> None:
    x = few_values((5, 4), 3)
    for name in ("nonzero", "x[mask]", "unique all", "bincount weights minlength", "histogram", "histc range",
                 "histogramdd range density", "unique dim", "repeat_interleave dim", "take"):
        want = ONE[name](x)
        got = ONE[name](monarch.distribute_tensor(x, procs, {"dp": S0, "tp": Shard(1)}))
        for g, w in zip(tree_leaves(got), tree_leaves(want), strict=True):
            assert torch.equal(g.full_tensor(timeout=30), w), name
