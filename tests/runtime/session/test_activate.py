"""`procs.activate()` on real worker processes: what torch's factories make inside the block, and that
reading data there (full_tensor, fetch, full_state_dict, torch.save of it) gives plain tensors, as outside.
"""
from __future__ import annotations

import copy
import io

import torch
from torch import nn

import monarch
from monarch import MeshTensor, Shard
from monarch.actor import ProcMesh

T = 30.0  # seconds any single wait may take


def trained(procs: ProcMesh) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """A Linear, data parallel over dp and column-parallel over tp, and its Adam after one step, next to
    the same in plain torch."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 6)
    model = monarch.data_parallel(copy.deepcopy(ref), procs, dim="dp")
    monarch.parallelize_module(model, procs, {"": monarch.ColwiseParallel(dim="tp")})
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, ref)]
    x = torch.randn(8, 4)
    for m, opt in zip((model, ref), opts, strict=True):
        m(x).pow(2).mean().backward()
        opt.step()
    return model, opts[0], ref, opts[1]


def test_reads_inside_activate_give_plain_tensors(procs: ProcMesh) -> None:
    data = torch.arange(8.0).reshape(4, 2)
    with procs.activate():
        sharded = monarch.distribute_tensor(data, procs, {"dp": Shard(0), "tp": Shard(1)})
        replicated = monarch.distribute_tensor(data, procs)
        reads = [sharded.full_tensor(timeout=T), replicated.full_tensor(timeout=T), monarch.fetch(sharded).get(T)]
        assert sharded.tolist() == data.tolist() and sharded.sum().item() == data.sum().item()
    for got in reads:
        assert type(got) is torch.Tensor and torch.equal(got, data)


def test_full_state_dict_inside_activate_is_plain_and_saves(procs: ProcMesh) -> None:
    model, opt, ref, ref_opt = trained(procs)
    with procs.activate():
        state, opt_state = monarch.full_state_dict(model, timeout=T), monarch.full_state_dict(opt, timeout=T)
        saved = io.BytesIO()
        torch.save({"model": state, "opt": opt_state}, saved)
    assert all(type(v) is torch.Tensor for v in state.values())
    assert all(type(v) is torch.Tensor for s in opt_state["state"].values() for v in s.values())
    saved.seek(0)
    loaded = torch.load(saved)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(loaded["model"][k], v)
    for i, s in ref_opt.state_dict()["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(loaded["opt"]["state"][i][k], v)
    assert isinstance(model.weight, MeshTensor)  # the model itself stays on the mesh
