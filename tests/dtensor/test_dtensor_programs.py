"""DTensor programs written only with DTensor's names (imported from monarch.dtensor instead of
torch.distributed.tensor), on a real 2-process mesh: a tensor-parallel MLP, and a transformer block built on the
meta device, parallelised, materialised with to_empty and loaded with plain torch's weights. Values and gradients
equal plain torch's; the collectives are counted with CommDebugMode."""
from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from monarch.dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from monarch.dtensor.debug import CommDebugMode
from monarch.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

funcol = torch.ops.c10d_functional


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    yield mesh
    mesh.stop().get(timeout=60)


def test_a_tensor_parallel_mlp(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    model = parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert model[0].weight.placements == (Shard(0),) and model[2].weight.placements == (Shard(1),)
    x = torch.randn(4, 8)
    with CommDebugMode() as comm:
        out = model(x)
        out.sum().backward()
        got = out.full_tensor()
    assert comm.get_comm_counts()[funcol.all_reduce] >= 1  # the row-parallel output's partial sums
    want = ref(x)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
        assert p.grad.placements == p.placements, name  # a tensor-parallel weight's gradient stays sharded
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_a_meta_initialised_transformer_block(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    with torch.device("meta"):
        block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    parallelize_module(block, mesh, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})
    assert all(p.is_meta for p in block.parameters())
    assert block.linear1.weight.placements == (Shard(0),)
    block.to_empty(device="cpu")
    assert not any(p.is_meta for p in block.parameters())
    block.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    out = block(distribute_tensor(x, mesh, [Replicate()]))
    want = ref(x)
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(block.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
