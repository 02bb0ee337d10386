"""Compiled Adam steps: capturable Adam accepts MeshTensors (device cpu) only while a step is recorded;
torch's own `_get_capturable_supported_devices` is back after recording, also when the step raises."""
from __future__ import annotations

import pytest
import torch
from torch.optim import adam, optimizer

import monarch
from monarch import Shard
from monarch.runtime.session.local import LocalMesh


def torch_own() -> bool:
    return adam._get_capturable_supported_devices is optimizer._get_capturable_supported_devices


def test_the_hook_is_installed_only_while_a_step_is_recorded() -> None:
    mesh = LocalMesh({"dp": 2})
    w = monarch.distribute_tensor(torch.ones(4, 2), mesh).requires_grad_(True)
    x = monarch.distribute_tensor(torch.ones(6, 4), mesh, {"dp": Shard(0)})
    opt = torch.optim.AdamW([w], lr=0.1)
    seen = []

    @monarch.compile
    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append("cpu" in adam._get_capturable_supported_devices())
        loss = (x @ w).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert torch_own()
    for _ in range(3):
        step(x)
    assert seen == [True] * step.traces and step.traces < 3  # the later calls replay
    assert torch_own()
    ref = torch.ones(4, 2, requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=0.1)
    for _ in range(3):
        (torch.ones(6, 4) @ ref).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(w.full_tensor(), ref.detach())


def test_the_hook_is_removed_when_recording_raises() -> None:
    mesh = LocalMesh({"dp": 2})
    w = monarch.distribute_tensor(torch.ones(3), mesh).requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.1)

    @monarch.compile
    def step(x: torch.Tensor) -> torch.Tensor:
        (x * w).sum().backward()
        opt.step()
        raise ValueError("the step fails after the optimizer ran")

    with pytest.raises(ValueError, match="the step fails"):
        step(monarch.distribute_tensor(torch.ones(3), mesh))
    assert torch_own()


def test_an_optimizer_a_compiled_step_made_capturable_still_steps_eagerly() -> None:
    mesh = LocalMesh({"dp": 2})
    w = monarch.distribute_tensor(torch.ones(4, 2), mesh).requires_grad_(True)
    x = monarch.distribute_tensor(torch.ones(6, 4), mesh, {"dp": Shard(0)})
    opt = torch.optim.AdamW([w], lr=0.1)
    ref = torch.ones(4, 2, requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=0.1)

    def run(weight: torch.Tensor, inputs: torch.Tensor, o: torch.optim.Optimizer) -> None:
        (inputs @ weight).sum().backward()
        o.step()
        o.zero_grad()

    step = monarch.compile(lambda x: run(w, x, opt) or (x @ w).sum())
    for _ in range(2):
        step(x)
        run(ref, torch.ones(6, 4), ref_opt)
    run(w, x, opt)  # eagerly, after the compiled steps made the optimizer capturable
    run(ref, torch.ones(6, 4), ref_opt)
    assert torch_own()
    torch.testing.assert_close(w.full_tensor(), ref.detach())
