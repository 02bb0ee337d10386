"""The main example's GPT (examples/gpt.py): it trains in plain torch, and on a LocalMesh reference mesh
(tensor-parallel plan and data parallelism, eager and compiled) its losses and parameters equal plain
torch's step by step, with every op covered by a sharding rule (MONARCH_STRICT=1).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import monarch
from monarch import MeshTensor, Replicate, Shard
from monarch.runtime.session.local import LocalMesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

CFG = gpt.GPTConfig(d_model=32, n_layer=2, n_head=4, context=16)
BATCH, STEPS, LR = 4, 3, 1e-2
WORDS = b"monarch mesh tensor shard replicate partial actor endpoint controller worker".split()
Optimizer = Callable[[nn.Module], torch.optim.Optimizer]


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    """Fixed text (the repo's own files change under the tests): seeded random sentences of a few words."""
    picks = torch.randint(0, len(WORDS), (8000,), generator=torch.Generator().manual_seed(0))
    return torch.tensor(list(b" ".join(WORDS[i] for i in picks.tolist())), dtype=torch.int64)


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_STRICT", "1")


def test_repo_text_and_batches_are_deterministic() -> None:
    data = gpt.load_text()
    assert data.dtype == torch.int64 and int(data.max()) < gpt.VOCAB and len(data) > 1 << 16
    a, b = gpt.batches(data, BATCH, CFG.context, seed=3), gpt.batches(data, BATCH, CFG.context, seed=3)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert xa.shape == ya.shape == (BATCH, CFG.context)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # the target is the input shifted by one byte


def test_plain_torch_loss_goes_down(text: torch.Tensor) -> None:
    losses = gpt.train_torch(CFG, 12, 8, lr=LR, data=text)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(gpt.VOCAB))).item(), rel=0.1)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


def test_heads_must_split_evenly() -> None:
    with pytest.raises(AssertionError, match="heads"):
        gpt.GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="4 heads do not split evenly over tp=3"):
        gpt.tp_plan(CFG, 3)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return gpt.optimizer(model, LR)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)


def run(text: torch.Tensor, mesh: LocalMesh | None = None, compiled: bool = False, sharded_inputs: bool = False,
        optimizer: Optimizer = adamw) -> tuple[list[float], gpt.GPT]:
    """STEPS steps from seed 0: plain torch without a mesh, else tensor- and data-parallel on `mesh`
    (batches passed as plain tensors, or as MeshTensors sharded over dp with `sharded_inputs`)."""
    model = gpt.build(CFG)
    if mesh is not None and "tp" in mesh.extent:
        monarch.parallelize_module(model, mesh, gpt.tp_plan(CFG, mesh.size("tp")))
    if mesh is not None:
        monarch.data_parallel(model, mesh, dim="dp")
    step = gpt.train_step(model, optimizer(model))
    step = gpt.compile_step(step, eager=not compiled) if mesh is not None else step
    stream = gpt.batches(text, BATCH, CFG.context, seed=0)
    losses = []
    for _ in range(STEPS):
        x, y = next(stream)
        if sharded_inputs:
            x, y = (monarch.distribute_tensor(t, mesh, {"dp": Shard(0)}) for t in (x, y))
        losses.append(step(x, y).item())
    return losses, model


def check_placements(model: gpt.GPT, dims: dict[str, int]) -> None:
    """The plan's placements survive the optimizer's in-place updates."""
    attn = model.blocks[0].attn
    assert isinstance(attn, gpt.CausalSelfAttention)
    qkv, out = attn.qkv.weight, attn.out.weight
    assert isinstance(qkv, MeshTensor) and isinstance(out, MeshTensor)
    if "tp" in dims:
        assert qkv.placements == (Replicate(), Shard(0)) and out.placements == (Replicate(), Shard(1))
    else:
        assert qkv.placements == out.placements == (Replicate(),)


@pytest.fixture(scope="module")
def plain(text: torch.Tensor) -> list[float]:
    return run(text)[0]


@pytest.mark.parametrize("dims,compiled,sharded_inputs", [
    ({"dp": 2}, False, False), ({"dp": 2}, True, False), ({"dp": 2, "tp": 2}, False, False),
    ({"dp": 2, "tp": 2}, True, False), ({"dp": 2, "tp": 2}, True, True)],
    ids=["dp2-eager", "dp2-compiled", "dp2xtp2-eager", "dp2xtp2-compiled", "dp2xtp2-compiled-sharded-inputs"])
def test_adamw_losses_equal_plain_torch(text: torch.Tensor, plain: list[float], dims: dict[str, int],
                                        compiled: bool, sharded_inputs: bool) -> None:
    got, model = run(text, LocalMesh(dims), compiled, sharded_inputs)
    assert got == pytest.approx(plain, rel=1e-4, abs=1e-5)
    check_placements(model, dims)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sgd_parameters_equal_plain_torch(text: torch.Tensor, compiled: bool) -> None:
    """Parameters after training, compared with SGD: AdamW's normalised updates would turn the rounding
    noise of near-zero gradients (e.g. the key bias's, which softmax ignores) into differences of lr."""
    dims = {"dp": 2, "tp": 2}
    got, model = run(text, LocalMesh(dims), compiled, optimizer=sgd)
    want, reference = run(text, optimizer=sgd)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    params = monarch.full_state_dict(model)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    check_placements(model, dims)
