"""DTensor's tensor-parallel API on real worker processes, written with DTensor's names only: a TP MLP
(ColwiseParallel then RowwiseParallel) on `mesh["tp"]` of a dp x tp mesh from init_device_mesh and on a
1-D tp mesh of its 4 processes (`mesh.flatten("tp")`), trained two SGD steps against plain torch (losses,
gradients, parameters), its collectives counted by CommDebugMode; and a PrepareModuleInput there too.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from monarch.dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from monarch.dtensor.debug import CommDebugMode
from monarch.dtensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from tests.end_to_end.test_parallel import MLP

T = 60.0  # seconds any single wait may take (the workers load torch on the first tensor op)


@pytest.fixture(scope="module")
def procs() -> Iterator[DeviceMesh]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    yield mesh
    mesh.stop()


def value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor(timeout=T) if isinstance(t, DTensor) else t


def close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(value(got), want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD steps: the losses, and the gradients of the first step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads = grads or {n: value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(value(loss).item())
    return losses, grads


@pytest.mark.parametrize("tp", ["mesh['tp']", "1-D"])
def test_tp_mlp_trains_as_plain_torch(procs: Any, tp: str) -> None:
    tp_mesh = procs["tp"] if tp == "mesh['tp']" else procs.flatten("tp")
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    assert model.fc1.weight.placements[-1] == Shard(0) and model.fc2.weight.placements[-1] == Shard(1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(2)]
    with CommDebugMode() as comm:
        model(batches[0][0])
    assert comm.get_comm_counts_by_dim() == {"tp": {"all_reduce": 1}}, comm.collectives
    (got, got_grads), (want, want_grads) = train(model, batches), train(ref, batches)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    for name, grad in want_grads.items():
        close(got_grads[name], grad, name)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        close(p, q.detach(), name)


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:
        return 2 * x + bias


def test_prepare_module_input_on_procs(procs: Any) -> None:
    mod = parallelize_module(Scaled(), procs["tp"], PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        input_kwarg_layouts={"bias": Replicate()}, desired_input_kwarg_layouts={"bias": Shard(1)}))
    x, bias = torch.randn(4, 6), torch.randn(4, 6)
    with CommDebugMode() as comm:
        out = mod(distribute_tensor(x, procs["tp"], [Shard(0)]), bias=bias)
    assert comm.collectives == ["all_gather[tp]"] and out.placements == (Replicate(), Shard(1))
    close(out, 2 * x + bias)
