"""`torch.autocast` on MeshTensors gives plain torch's autocast results: nn.TransformerEncoder (whose
projections and batched matmuls monarch records as its own ops) and a Linear MLP, bfloat16 on cpu, eager
and compiled, on a real dp=2 x tp=2 mesh: the outputs (dtypes and values), the gradients of a backward
taken outside the autocast block, and several SGD steps.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import monarch
from monarch.actor import ProcMesh

T = 60.0  # seconds any single wait may take
TOL = dict(rtol=2e-2, atol=2e-2)  # bfloat16 keeps 8 bits of mantissa


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def autocast_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


@pytest.mark.parametrize("build", [encoder, mlp])
def test_autocast_forward_and_backward_equal_torch(procs: ProcMesh, build) -> None:
    torch.manual_seed(0)
    ref = build()
    model = monarch.data_parallel(copy.deepcopy(ref), procs, dim="dp")
    x = torch.randn(4, 5, 16)
    want, got = autocast_forward(ref, x), autocast_forward(model, x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.full_tensor(timeout=T), want, **TOL)
    want.float().square().mean().backward()
    got.float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == q.grad.dtype, name
        torch.testing.assert_close(p.grad.full_tensor(timeout=T), q.grad, **TOL, msg=name)


def test_autocast_in_a_compiled_step_equals_torch(procs: ProcMesh) -> None:
    torch.manual_seed(0)
    ref = encoder()
    model = monarch.data_parallel(copy.deepcopy(ref), procs, dim="dp")

    def step_of(m: nn.Module):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = autocast_forward(m, x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    compiled, plain = monarch.compile(step_of(model)), step_of(ref)
    for _ in range(3):
        x = torch.randn(4, 5, 16)
        torch.testing.assert_close(compiled(x).full_tensor(timeout=T), plain(x), **TOL)
    got = monarch.full_state_dict(model, timeout=T)
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(got[name], w, **TOL, msg=name)
