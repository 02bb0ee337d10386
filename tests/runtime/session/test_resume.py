"""Save -> load -> continue on MeshTensors gives the uninterrupted run, on real worker processes.

`full_state_dict` of a model and its optimizer after K steps, loaded into a fresh model (parallelized
before or after loading) and a fresh optimizer, continues with the losses of N uninterrupted steps, eager
and compiled, for SGD with momentum, Adam and AdamW, with data_parallel alone and with parallelize_module
over tp. Loaded state tensors are MeshTensors placed like their parameters; state dicts that hold
MeshTensors of the same mesh (other placements) or of another mesh load too; plain optimizers are unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import monarch
from monarch import ColwiseParallel, MeshTensor, Replicate, RowwiseParallel
from monarch.actor import ProcMesh
from monarch.runtime.session.local import LocalMesh

T = 60.0  # seconds any single wait may take
N, K = 4, 2  # steps in all, steps before the checkpoint
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def parallelize(model: nn.Module, mesh: Any, tp: bool) -> nn.Module:
    monarch.data_parallel(model, mesh)
    if tp:
        monarch.parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(n)]


def stepper(model: nn.Module, opt: torch.optim.Optimizer, compiled: bool) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return monarch.compile(step) if compiled else step


def losses(step: Step, data: list) -> list[float]:
    out = [step(x, y) for x, y in data]
    return [(t.full_tensor(timeout=T) if isinstance(t, MeshTensor) else t).item() for t in out]


def assert_placed_like_params(opt: torch.optim.Optimizer, compiled: bool) -> None:
    """Every state tensor is a MeshTensor of its parameter's mesh and placements; `step` as torch keeps it
    (a plain scalar), or as monarch.compile keeps it (a replicated MeshTensor)."""
    assert opt.state
    for p, state in opt.state.items():
        for key, t in state.items():
            if key == "step" and not compiled:
                assert type(t) is torch.Tensor and t.ndim == 0, (key, type(t))
                continue
            assert isinstance(t, MeshTensor) and t._backend is p._backend, (key, type(t))
            want = (Replicate(),) * len(p.placements) if key == "step" else p.placements
            assert t.placements == want, (key, t.placements, want)


def check_resume(mesh: Any, opt_name: str, tp: bool, compiled: bool, parallel_first: bool = True) -> None:
    data = batches(N)
    model = parallelize(make_model(0), mesh, tp)
    want = losses(stepper(model, OPTIMIZERS[opt_name](model.parameters()), compiled), data)

    model = parallelize(make_model(0), mesh, tp)
    opt = OPTIMIZERS[opt_name](model.parameters())
    got = losses(stepper(model, opt, compiled), data[:K])
    saved_model, saved_opt = monarch.full_state_dict(model, T), monarch.full_state_dict(opt, T)
    assert all(type(t) is torch.Tensor for s in saved_opt["state"].values() for t in s.values())

    fresh = make_model(7)  # other initial weights: only the checkpoint makes the runs agree
    if parallel_first:
        parallelize(fresh, mesh, tp)
    fresh.load_state_dict(saved_model)
    if not parallel_first:
        parallelize(fresh, mesh, tp)
    opt2 = OPTIMIZERS[opt_name](fresh.parameters())
    opt2.load_state_dict(saved_opt)
    assert_placed_like_params(opt2, compiled)
    got += losses(stepper(fresh, opt2, compiled), data[K:])
    assert got == pytest.approx(want, abs=1e-6, rel=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("tp", [False, True], ids=["dp", "dp_tp"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_resume_gives_the_uninterrupted_losses(procs: ProcMesh, opt_name: str, tp: bool, compiled: bool) -> None:
    check_resume(procs, opt_name, tp, compiled)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_resume_into_a_model_parallelized_after_loading(procs: ProcMesh, opt_name: str) -> None:
    check_resume(procs, opt_name, tp=True, compiled=False, parallel_first=False)


def test_rewinding_a_compiled_step_to_a_checkpoint(procs: ProcMesh) -> None:
    """Loading the checkpoint back into the model and optimizer a compiled step uses (which went on
    training) makes the step continue from the checkpoint."""
    data = batches(N)
    model = parallelize(make_model(0), procs, True)
    want = losses(stepper(model, OPTIMIZERS["adam"](model.parameters()), True), data)
    model = parallelize(make_model(0), procs, True)
    opt = OPTIMIZERS["adam"](model.parameters())
    step = stepper(model, opt, True)
    got = losses(step, data[:K])
    saved_model, saved_opt = monarch.full_state_dict(model, T), monarch.full_state_dict(opt, T)
    losses(step, data[K:])
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert_placed_like_params(opt, compiled=True)
    assert got + losses(step, data[K:]) == pytest.approx(want, abs=1e-6, rel=0)


def trained(mesh: Any, tp: bool, steps: int = K) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = parallelize(make_model(0), mesh, tp)
    opt = OPTIMIZERS["adam"](model.parameters())
    losses(stepper(model, opt, False), batches(steps))
    return model, opt


@pytest.mark.parametrize("source", ["same mesh", "other mesh"])
def test_state_dicts_holding_mesh_tensors_load(procs: ProcMesh, source: str) -> None:
    """The live state dicts of a dp-only run (other placements, or on an in-process mesh) load into a
    dp x tp model and optimizer on procs: each tensor is redistributed or moved to its target's place."""
    ref_model, ref_opt = trained(procs, tp=True)
    model, opt = trained(procs if source == "same mesh" else LocalMesh({"dp": 2, "tp": 2}), tp=False)
    fresh = parallelize(make_model(7), procs, tp=True)
    fresh.load_state_dict(model.state_dict())
    opt2 = OPTIMIZERS["adam"](fresh.parameters())
    opt2.load_state_dict(opt.state_dict())
    assert_placed_like_params(opt2, compiled=False)
    assert fresh[0].weight.placements == ref_model[0].weight.placements
    for a, b in zip(fresh.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(timeout=T), b.full_tensor(timeout=T))
    data = batches(N)[K:]
    assert losses(stepper(fresh, opt2, False), data) == pytest.approx(losses(stepper(ref_model, ref_opt, False), data),
                                                                      abs=1e-6, rel=0)


def test_plain_optimizers_load_as_in_torch(procs: ProcMesh) -> None:
    """A plain model's optimizer keeps torch's policy (the loaded tensors themselves); MeshTensor state
    loaded into it is gathered to plain tensors."""
    plain = make_model(0)
    opt = OPTIMIZERS["adam"](plain.parameters())
    losses(stepper(plain, opt, False), batches(1))
    saved = opt.state_dict()
    opt2 = OPTIMIZERS["adam"](make_model(7).parameters())
    opt2.load_state_dict(saved)
    assert opt2.state_dict()["state"][0]["exp_avg"] is saved["state"][0]["exp_avg"]
    _, mesh_opt = trained(procs, tp=True)
    opt3 = OPTIMIZERS["adam"](make_model(7).parameters())
    opt3.load_state_dict(mesh_opt.state_dict())
    full = monarch.full_state_dict(mesh_opt, T)["state"]
    for i, state in opt3.state_dict()["state"].items():
        for key, t in state.items():
            assert type(t) is torch.Tensor
            torch.testing.assert_close(t, full[i][key])
