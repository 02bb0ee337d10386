"""Ops without a sharding rule recorded as their decompositions (graph/decompose.py), on the reference mesh:
values equal plain torch in strict mode, sharded inputs stay sharded, in-place and out= variants write their
target, a decomposition reaching an op without a rule is refused (strict) or gathered, random ops are not
decomposed.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import monarch
from monarch import Replicate, Shard
from monarch.errors import UnsupportedOpError
from monarch.graph import decompose, propagate
from monarch.graph.decompose import decomposition
from monarch.graph.rules.table import RULES
from monarch.runtime.session.local import LocalMesh

aten = torch.ops.aten
R = Replicate()


@pytest.fixture
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


def without_rules(monkeypatch: pytest.MonkeyPatch, *ops: torch._ops.OpOverload) -> None:
    """Run the test as if `ops` had no rule (and no dry run had been cached)."""
    for op in ops:
        monkeypatch.delitem(RULES, op, raising=False)
    monkeypatch.setattr(decompose, "_verdicts", {})


def collectives(mesh: LocalMesh, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    s = mesh.session
    s.flush()
    n = len(s.collectives)
    out = fn()
    s.flush()
    return out, s.collectives[n:]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.full_tensor(timeout=30), want, rtol=1e-5, atol=1e-6)


CASES: dict[str, tuple[torch._ops.OpOverload, Callable[..., Any]]] = {
    "hardswish": (aten.hardswish.default, F.hardswish),
    "mse_loss": (aten.mse_loss.default, lambda x: F.mse_loss(x, x * 0.5 + 1)),
    "huber_loss": (aten.huber_loss.default, lambda x: F.huber_loss(x, x * x, reduction="sum")),
    "logaddexp": (aten.logaddexp.default, lambda x: torch.logaddexp(x, x * 2)),
}


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("name", sorted(CASES))
def test_decomposed_op_matches_torch_without_gathering(name: str, mesh: LocalMesh,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    op, fn = CASES[name]
    without_rules(monkeypatch, op)
    assert decomposition(op) is not None
    x = torch.randn(8, 6)
    dx = monarch.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    got, comms = collectives(mesh, lambda: fn(dx))
    close(got, fn(x))
    if got.ndim:
        assert got.placements == (Shard(0), Shard(1)) and comms == []  # pointwise: nothing moves
    else:
        assert all(c.startswith("all_reduce") for c in comms) and len(comms) <= 2  # a loss: one sum per mesh dim


@pytest.mark.usefixtures("strict")
def test_inplace_decomposition_writes_its_target(mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    without_rules(monkeypatch, aten.hardswish_.default)
    x = torch.randn(8, 6)
    dx = monarch.distribute_tensor(x, mesh, [Shard(0), R])
    alias = dx
    out = F.hardswish(dx, inplace=True)
    assert out is dx and alias is dx
    close(dx, F.hardswish(x))


@pytest.mark.usefixtures("strict")
def test_out_variant_writes_out(mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    without_rules(monkeypatch, aten.logaddexp.out)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    da, db = (monarch.distribute_tensor(t, mesh, [Shard(0), R]) for t in (a, b))
    out = monarch.distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), R])
    got = torch.logaddexp(da, db, out=out)
    assert got is out
    close(out, torch.logaddexp(a, b))


def test_decomposition_reaching_an_op_without_rule(mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strict: refused, naming the op the decomposition lacks; otherwise the op gathers and is right."""
    without_rules(monkeypatch, aten.hardswish.default, aten.clamp.default)
    monkeypatch.setattr(decompose, "MAX_DEPTH", 1)  # clamp may not decompose in turn
    x = torch.randn(8, 6)
    dx = monarch.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    monkeypatch.setenv("MONARCH_STRICT", "1")
    with pytest.raises(UnsupportedOpError,
                       match="hardswish: no sharding rule, and its decomposition needs aten::clamp"):
        F.hardswish(dx)
    monkeypatch.delenv("MONARCH_STRICT")
    monkeypatch.setattr(propagate, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = F.hardswish(dx)
    assert any("hardswish has no sharding rule" in str(w.message) for w in caught)
    assert got.placements == (R, R)
    close(got, F.hardswish(x))


def test_random_and_view_ops_are_not_decomposed(monkeypatch: pytest.MonkeyPatch) -> None:
    without_rules(monkeypatch, aten.uniform.default, aten.native_dropout.default, aten.unfold.default)
    for op in (aten.uniform.default, aten.native_dropout.default):
        assert torch.Tag.nondeterministic_seeded in op.tags and decomposition(op) is None
    assert decomposition(aten.unfold.default) is None  # a view must alias its base


def test_depth_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    without_rules(monkeypatch, aten.hardswish.default)
    assert decomposition(aten.hardswish.default) is not None
    token = decompose._depth.set(decompose.MAX_DEPTH)
    try:
        assert decomposition(aten.hardswish.default) is None
    finally:
        decompose._depth.reset(token)
