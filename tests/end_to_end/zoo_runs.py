"""Training a model of the zoo (examples/zoo.py) on a mesh and in plain torch, and the check that both agree.

A mesh with a "dp" dim trains data-parallel; one with a "tp" dim follows the model's plan (its parameters
replicated over tp where it has none). Losses and every parameter and buffer must equal plain torch's.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import monarch
from monarch import MeshTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import zoo  # noqa: E402

T = 60.0  # seconds any single wait may take
STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-5)


def value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor(timeout=T) if isinstance(t, MeshTensor) else t


def train(model: nn.Module, entry: zoo.Model, data: list[zoo.Batch], compiled: bool = False) -> list[float]:
    step = zoo.train_step(model, zoo.optimizer(model), entry.loss)
    step = monarch.compile(step) if compiled else step
    return [value(step(*batch)).item() for batch in data]


def parallelize(model: nn.Module, mesh: Any, entry: zoo.Model, size: zoo.Size) -> nn.Module:
    if "dp" in mesh.extent:
        monarch.data_parallel(model, mesh)
    plan = entry.plan(size, mesh.size("tp")) if "tp" in mesh.extent and entry.plan is not None else {}
    return monarch.parallelize_module(model, mesh, plan)


def assert_same_state(model: nn.Module, ref: nn.Module) -> None:
    """Parameters and buffers (BatchNorm's running statistics included) equal plain torch's."""
    got, want = monarch.full_state_dict(model, timeout=T), ref.state_dict()
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def check_same(entry: zoo.Model, mesh: Any, compiled: bool, size: zoo.Size = zoo.Size()) -> nn.Module:
    """STEPS steps of `entry` on `mesh` and in plain torch from the same weights; returns the mesh model."""
    torch.manual_seed(0)
    ref = entry.build(size)
    model = parallelize(copy.deepcopy(ref), mesh, entry, size)
    data = entry.data(size, STEPS, 1)
    got = train(model, entry, data, compiled)
    assert got == pytest.approx(train(ref, entry, data), rel=1e-5, abs=1e-6)
    assert_same_state(model, ref)
    return model


def conv_inputs(model: nn.Module) -> list[MeshTensor]:
    """The inputs every Conv2d of `model` sees from now on (forward pre-hooks)."""
    seen: list[MeshTensor] = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    return seen
