"""`procs.activate()` on real worker processes: what torch's factories make inside the block, and that
reading data there (full_tensor, fetch, full_state_dict, torch.save of it) gives plain tensors, as outside.

Inside the block the mesh is the default device: every factory given no device makes a replicated
MeshTensor equal to what plain torch makes; an explicit device is kept (and user code asking for the
mesh's device by name is warned once); torch's own host tensors (Adam's step) stay plain.
"""
from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import monarch
from monarch import MeshTensor, Replicate, Shard
from monarch.actor import ProcMesh
from monarch.runtime.session import api

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


FACTORIES: list[Callable[[], torch.Tensor]] = [
    lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]]), lambda: torch.tensor(7), lambda: torch.as_tensor([1, 2, 3]),
    lambda: torch.asarray([[1.5], [2.5]]), lambda: torch.scalar_tensor(2.0), lambda: torch.eye(3),
    lambda: torch.linspace(0, 1, 5), lambda: torch.logspace(0, 2, 3), lambda: torch.tril_indices(3, 3),
    lambda: torch.hann_window(4), lambda: torch.full((2, 3), 4.0), lambda: torch.full((2,), 3),
    lambda: torch.arange(1, 7, 2), lambda: torch.zeros(2, 3, dtype=torch.int32), lambda: torch.ones((2, 2)),
    lambda: torch.zeros(3, layout=torch.strided), lambda: torch.ones(2, pin_memory=False),
]


@pytest.mark.parametrize("make", FACTORIES, ids=range(len(FACTORIES)))
def test_every_default_device_factory_makes_a_replicated_mesh_tensor(procs: ProcMesh, make: Callable) -> None:
    want = make()
    with procs.activate():
        got = make()
    assert isinstance(got, MeshTensor) and got.placements == (Replicate(), Replicate())
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.full_tensor(timeout=T), want)


def test_random_factories_and_requires_grad_inside_activate(procs: ProcMesh) -> None:
    with procs.activate():
        monarch.manual_seed(3)
        perm, ints, normal = torch.randperm(6), torch.randint(0, 10, (5,)), torch.randn(3, 2)
        monarch.manual_seed(3)
        again = torch.randperm(6)
        weights, scalar = torch.ones(2, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    for t in (perm, ints, normal, weights, scalar):
        assert isinstance(t, MeshTensor) and t.placements == (Replicate(), Replicate())
    assert sorted(perm.tolist()) == list(range(6)) and perm.tolist() == again.tolist()
    assert ints.dtype == torch.int64 and 0 <= ints.min().item() and ints.max().item() < 10
    assert normal.shape == (3, 2) and normal.dtype == torch.float32
    for t in (weights, scalar):
        assert t.is_leaf and t.requires_grad
    (weights * 3).sum().backward()
    assert torch.equal(weights.grad.full_tensor(timeout=T), torch.full((2,), 3.0))


@pytest.mark.parametrize("draw", [lambda: torch.randperm(4), lambda: torch.rand(4, generator=torch.Generator())],
                         ids=["randperm", "generator"])
def test_a_compiled_step_refuses_draws_made_on_the_controller(procs: ProcMesh, draw: Callable) -> None:
    """They would be recorded once and replayed by every call; monarch's own draws differ per call."""
    x = monarch.distribute_tensor(torch.arange(4.0), procs)

    @monarch.compile
    def step(a: MeshTensor, own: bool) -> MeshTensor:
        return a + (torch.rand(4) if own else draw())
    with procs.activate():
        with pytest.raises(monarch.TraceError, match="draws on the controller, once"):
            step(x, False)
        first, second = step(x, True).tolist(), step(x, True).tolist()
    assert first != second


def test_an_explicit_device_is_kept_and_the_mesh_device_by_name_warned_once(
        procs: ProcMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_warned", set())
    with procs.activate():
        with pytest.warns(UserWarning, match=r"torch.randn inside procs.activate\(\) makes a plain tensor.*"
                                             r"drop device="):
            host = torch.randn(2, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            more = [torch.zeros(2, device=torch.device("cpu")), torch.tensor([1.0], device="cpu")]
            meta = torch.empty(4, 4, device="meta")
    assert all(type(t) is torch.Tensor for t in (host, *more)) and meta.is_meta


def test_modules_and_optimizers_built_and_stepped_inside_activate(procs: ProcMesh) -> None:
    """Every parameter and buffer of a module built in the block is on the mesh (a BatchNorm's
    num_batches_tracked too); Adam keeps its step a plain host scalar, as torch does, and trains as torch."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    with procs.activate(), warnings.catch_warnings():
        warnings.simplefilter("error")
        built = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        model = copy.deepcopy(ref)
        monarch.data_parallel(model, procs, dim="dp")
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(isinstance(t, MeshTensor) for t in built.state_dict().values())
    assert all(type(s["step"]) is torch.Tensor for s in opt.state.values())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    plain_x = x.full_tensor(timeout=T)
    for _ in range(2):
        ref(plain_x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k].full_tensor(timeout=T), v, msg=lambda m, k=k: f"{k}: {m}")
