"""Weight-update sharding in compiled steps (MONARCH_SHARD_UPDATE, ZeRO-1/2): gradients are reduce-scattered,
each rank updates its slice of the parameters and of the optimizer state, the slices are all-gathered. The
parameters and the optimizer state equal an unsharded update's to float rounding (SGD with momentum, Adam,
AdamW; dp=2, dp=4, dp=2 x tp=2), the state lives sharded (1/W per rank), each step sends one reduce_scatter
bucket and one all_gather bucket, and the state keeps its meaning for state_dict() and checkpoints.
These run on the in-process reference mesh; tests/end_to_end/test_shard_update_procs.py runs them on
real processes."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import monarch
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import session_of
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import zoo  # noqa: E402

from tests.end_to_end import zoo_runs  # noqa: E402

T = 120.0
STEPS = 3
SIZE = zoo.Size(width=16, layers=1)
Optimizer = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)}
TOL = {"rtol": 1e-4, "atol": 1e-5}


def train(mesh: Any, optimizer: str, mode: str, monkeypatch: pytest.MonkeyPatch, model: str = "gpt"
          ) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """STEPS compiled steps of a zoo model on `mesh` (dp, and tp where the mesh has it) from seed 0."""
    monkeypatch.setenv("MONARCH_SHARD_UPDATE", mode)
    entry = zoo.ZOO[model]
    torch.manual_seed(0)
    m = zoo_runs.parallelize(entry.build(SIZE), mesh, entry, SIZE)
    opt = OPTIMIZERS[optimizer](m)
    step = monarch.compile(zoo.train_step(m, opt, entry.loss))
    losses = [zoo_runs.value(step(*batch)).item() for batch in entry.data(SIZE, STEPS, 1)]
    return m, opt, losses


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of `opt.state_dict()`, gathered: "index.name" -> its full value."""
    return {f"{i}.{k}": (v.full_tensor(timeout=T) if isinstance(v, MeshTensor) else v)
            for i, st in opt.state_dict()["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}


def assert_same_training(a: tuple[nn.Module, torch.optim.Optimizer, list[float]],
                         b: tuple[nn.Module, torch.optim.Optimizer, list[float]]) -> None:
    assert a[2] == pytest.approx(b[2], rel=1e-5)
    pa, pb = monarch.full_state_dict(a[0], timeout=T), monarch.full_state_dict(b[0], timeout=T)
    for name in pb:
        torch.testing.assert_close(pa[name], pb[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    sa, sb = optimizer_state(a[1]), optimizer_state(b[1])
    assert sa.keys() == sb.keys()
    for name in sb:
        torch.testing.assert_close(sa[name], sb[name], **TOL, msg=lambda m, n=name: f"state {n}: {m}")


def sharded_state(opt: torch.optim.Optimizer, dp: int) -> list[MeshTensor]:
    """The optimizer's state tensors that live sharded over mesh dim `dp` (of parameters with at least two rows)."""
    return [v for st in opt.state.values() for v in st.values()
            if isinstance(v, MeshTensor) and v.ndim and isinstance(v.placements[dp], Shard)]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sharded_updates_equal_unsharded_ones_dp2(optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = LocalMesh({"dp": 2})
    on = train(mesh, optimizer, "on", monkeypatch)
    off = train(mesh, optimizer, "off", monkeypatch)
    assert_same_training(on, off)
    state = [v for st in on[1].state.values() for v in st.values() if isinstance(v, MeshTensor) and v.ndim]
    assert state and sharded_state(on[1], 0) == state  # every tensor of the state: each rank holds half
    for v in state:
        assert sum(v._spec.local_shape((r,))[v.placements[0].dim] for r in range(2)) == v.shape[v.placements[0].dim]
    assert not sharded_state(off[1], 0)


def test_sharded_updates_over_dp4(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks, uneven slices among them (rows not divisible by 4 are split as torch.chunk splits them)."""
    mesh = LocalMesh({"dp": 4})
    assert_same_training(train(mesh, "adamw", "on", monkeypatch), train(mesh, "adamw", "off", monkeypatch))


@pytest.mark.parametrize("model", ["gpt", "encoder"])
def test_sharded_updates_with_tensor_parallel(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=2 x tp=2: a tensor-parallel weight's update is sharded over dp along a dim tp does not split."""
    mesh = LocalMesh({"dp": 2, "tp": 2})
    on = train(mesh, "adam", "on", monkeypatch, model)
    assert_same_training(on, train(mesh, "adam", "off", monkeypatch, model))
    both = [v for v in sharded_state(on[1], 0) if isinstance(v.placements[1], Shard)]
    assert both and all(v.placements[0].dim != v.placements[1].dim for v in both)


def test_one_reduce_scatter_and_one_all_gather_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = LocalMesh({"dp": 2})
    s = session_of(mesh)
    before = len(s.collectives)
    train(mesh, "adamw", "on", monkeypatch)
    assert s.collectives[before:] == ["reduce_scatter[dp]", "all_gather[dp]", "all_reduce[dp]"] * STEPS  # + loss


def test_auto_shards_only_parameters_past_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto with a 1 KiB threshold: the token embedding (96 x 16 floats) and the large matrices are sharded,
    biases and norms (16 floats) are reduced whole."""
    monkeypatch.setenv("MONARCH_SHARD_UPDATE_KB", "1")
    mesh = LocalMesh({"dp": 2})
    model, opt, _ = train(mesh, "sgd", "auto", monkeypatch)
    by_param = {id(p): st["momentum_buffer"] for p, st in opt.state.items()}
    for name, p in model.named_parameters():
        sharded = isinstance(by_param[id(p)].placements[0], Shard)
        assert sharded == (p.numel() * p.element_size() >= 1024), name


def test_a_checkpoint_of_sharded_state_loads_into_an_unsharded_optimizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state's meaning is global: saved from a sharded update, loaded where updates are not sharded (and
    back), it is the same state; an eager step after the compiled ones uses it as it is."""
    import monarch.checkpoint as mcp
    mesh = LocalMesh({"dp": 2})
    model, opt, _ = train(mesh, "adamw", "on", monkeypatch)
    mcp.save(mcp.get_state_dict(model, optimizers=opt), checkpoint_id=tmp_path / "ckpt", timeout=T)
    other, other_opt, _ = train(mesh, "adamw", "off", monkeypatch)
    sd = mcp.get_state_dict(other, optimizers=other_opt)
    mcp.load(sd, checkpoint_id=tmp_path / "ckpt", timeout=T)
    mcp.set_state_dict(other, other_opt, sd)
    assert_same_training((model, opt, []), (other, other_opt, []))


def test_an_optimizer_step_that_raises_gives_the_parameters_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """While it steps, an optimizer holds the parameters' slices; a step that raises (here its closure) leaves
    it holding the parameters again, and its state keyed by them."""
    model, opt, _ = train(LocalMesh({"dp": 2}), "sgd", "on", monkeypatch)

    def failing() -> torch.Tensor:
        raise RuntimeError("boom")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = zoo.ZOO["gpt"].loss(model(x), y)
        loss.backward()
        opt.step(failing)
        return loss
    with pytest.raises(RuntimeError, match="boom"):
        monarch.compile(step)(*zoo.ZOO["gpt"].data(SIZE, 1, 2)[0])
    params = list(model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert {id(p) for p in opt.state} == {id(p) for p in params}
