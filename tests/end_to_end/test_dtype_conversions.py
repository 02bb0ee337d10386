"""dtype conversions of parallelised modules on real worker processes, against the same in plain torch.

`module.to(dtype)`, `.half()`, `.double()`, `.float()` and `param.data = ...` change what every rank holds,
not only what the wrapper says: forward, backward and an optimizer built after the conversion match torch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import monarch
from monarch import ColwiseParallel, MeshTensor, RowwiseParallel
from monarch.actor import ProcMesh

T = 30.0  # seconds any single wait may take


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def pair(procs: ProcMesh) -> tuple[nn.Module, nn.Module]:
    """An MLP data parallel over dp and tensor parallel over tp, and the same MLP in plain torch."""
    torch.manual_seed(0)
    ref = MLP()
    model = monarch.data_parallel(copy.deepcopy(ref), procs, dim="dp")
    monarch.parallelize_module(model, procs, {"fc1": ColwiseParallel(dim="tp"), "fc2": RowwiseParallel(dim="tp")})
    return model, ref


def step(models: tuple[nn.Module, nn.Module], opts: list[torch.optim.Optimizer], dtype: torch.dtype) -> None:
    x = torch.randn(8, 4, dtype=dtype)
    for m, opt in zip(models, opts, strict=True):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same(model: nn.Module, ref: nn.Module, dtype: torch.dtype, tol: float = 1e-6) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, MeshTensor) and p.dtype == dtype == q.dtype, name
        torch.testing.assert_close(p.full_tensor(timeout=T), q.detach(), rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.float64)], ids=["double", "to"])
def test_training_after_conversion_and_back_matches_torch(procs: ProcMesh, convert: object) -> None:
    model, ref = pair(procs)
    x = torch.randn(8, 4)
    for m in (model, ref):
        m(x).sum().backward()  # gradients are converted too
        convert(m)  # type: ignore[operator]
    grad = model.fc1.weight.grad
    assert grad.dtype == grad.spec.dtype == torch.float64
    torch.testing.assert_close(grad.full_tensor(timeout=T), ref.fc1.weight.grad)  # summed in float32 by torch
    assert_same(model, ref, torch.float64, 1e-12)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, ref)]  # built after the conversion
    for _ in range(2):
        step((model, ref), opts, torch.float64)
    assert_same(model, ref, torch.float64)
    for m in (model, ref):
        m.float()
    step((model, ref), [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)], torch.float32)
    assert_same(model, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_matches_torch(procs: ProcMesh, dtype: torch.dtype) -> None:
    model, ref = pair(procs)
    for m in (model, ref):
        m.half() if dtype == torch.float16 else m.to(dtype)
    assert_same(model, ref, dtype)
    x = torch.randn(8, 4, dtype=dtype)
    torch.testing.assert_close(model(x).full_tensor(timeout=T), ref(x), rtol=2e-2, atol=2e-2)


def test_assigning_data(procs: ProcMesh) -> None:
    model, ref = pair(procs)
    w = model.fc1.weight
    placements = w.placements
    w.data = torch.ones(8, 4)  # a plain tensor of the same shape: placed like the parameter
    assert w.placements == placements and isinstance(w, nn.Parameter) and w.requires_grad
    assert torch.equal(w.full_tensor(timeout=T), torch.ones(8, 4))
    w.data = w.data.double() * 2  # a MeshTensor: the parameter names its shards
    assert w.dtype == torch.float64 and torch.equal(w.full_tensor(timeout=T), torch.full((8, 4), 2.0).double())
    model.fc2.bias.data = torch.arange(3.0)  # another shape: replicated
    assert model.fc2.bias.shape == (3,) and torch.equal(model.fc2.bias.full_tensor(timeout=T), torch.arange(3.0))
