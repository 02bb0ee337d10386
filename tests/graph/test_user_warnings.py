"""Warnings monarch raises point at the user's line, not at monarch's or torch's internals.

A pure controller-side check: the "no sharding rule" warning is issued while recording, so an
in-process LocalMesh records exactly as a real mesh does.
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import pytest
import torch

import monarch
from monarch.graph import decompose, propagate
from monarch.graph.rules.table import RULES
from monarch.runtime.session.local import LocalMesh


def recorded(fn: Callable[[], object]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "no sharding rule" in str(w.message)]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> LocalMesh:
    """A mesh, with every op's one-time warning not yet issued, and flip without a rule (its prims.rev's
    taken out of the table, and decompositions' verdicts kept apart from other tests')."""
    monkeypatch.setattr(propagate, "_warned", set())
    monkeypatch.delitem(RULES, torch.ops.prims.rev.default)
    monkeypatch.setattr(decompose, "_verdicts", {})
    return LocalMesh({"dp": 2})


def test_no_rule_warning_names_the_users_line(fresh: LocalMesh) -> None:
    x = monarch.randn(6, 4, mesh=fresh, placements={"dp": monarch.Shard(0)})
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    caught = recorded(lambda: torch.flip(x, [0]))
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_warning_through_torch_functions_and_backward(fresh: LocalMesh) -> None:
    """Frames of torch (nn.functional, autograd) are skipped too."""
    x = monarch.randn(6, 4, mesh=fresh, placements={"dp": monarch.Shard(0)}).requires_grad_()
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    caught = recorded(lambda: torch.nn.functional.pad(x.flip(0), (1, 1), mode="reflect").sum().backward())
    assert caught and {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
