"""The main example's GPT (examples/gpt.py): it trains in plain torch, and on a LocalMesh reference mesh
(tensor-parallel plan and data parallelism, eager and compiled) its losses equal plain torch's step by step,
with every op covered by a sharding rule (MONARCH_STRICT=1).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import monarch
from monarch import MeshTensor, Replicate, Shard
from monarch.runtime.reference import LocalMesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402

CFG = gpt.GPTConfig(d_model=32, n_layer=2, n_head=4, context=16)
BATCH, STEPS, LR = 4, 3, 1e-2


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return gpt.load_text()


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_STRICT", "1")


def test_text_and_batches_are_deterministic(text: torch.Tensor) -> None:
    assert text.dtype == torch.int64 and int(text.max()) < gpt.VOCAB and len(text) > 1 << 16
    a, b = gpt.batches(text, BATCH, CFG.context, seed=3), gpt.batches(text, BATCH, CFG.context, seed=3)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert xa.shape == ya.shape == (BATCH, CFG.context)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # the target is the input shifted by one byte


def test_plain_torch_loss_goes_down(text: torch.Tensor) -> None:
    losses = gpt.train_torch(CFG, 12, 8, lr=LR, data=text)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(gpt.VOCAB))).item(), rel=0.1)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


def test_heads_must_divide_the_width() -> None:
    with pytest.raises(AssertionError, match="heads"):
        gpt.GPTConfig(d_model=30, n_head=4)


def run(text: torch.Tensor, mesh: LocalMesh | None = None, compiled: bool = False) -> tuple[list[float], gpt.GPT]:
    """STEPS steps from seed 0: plain torch without a mesh, else tensor- and data-parallel on `mesh`."""
    model = gpt.build(CFG)
    if mesh is not None and "tp" in mesh.extent:
        monarch.parallelize_module(model, mesh, gpt.tp_plan())
    if mesh is not None:
        monarch.data_parallel(model, mesh, dim="dp")
    step = gpt.train_step(model, gpt.optimizer(model, LR))
    step = gpt.compile_step(step, eager=not compiled) if mesh is not None else step
    stream = gpt.batches(text, BATCH, CFG.context, seed=0)
    losses = []
    for _ in range(STEPS):
        x, y = next(stream)
        if mesh is not None:
            x, y = (monarch.distribute_tensor(t, mesh, {"dp": Shard(0)}) for t in (x, y))
        losses.append(step(x, y).item())
    return losses, model


@pytest.fixture(scope="module")
def plain(text: torch.Tensor) -> tuple[list[float], gpt.GPT]:
    return run(text)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dims", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "dp2xtp2"])
def test_mesh_losses_equal_plain_torch(text: torch.Tensor, plain: tuple[list[float], gpt.GPT],
                                       dims: dict[str, int], compiled: bool) -> None:
    got, model = run(text, LocalMesh(dims), compiled)
    want, reference = plain
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    params = monarch.full_state_dict(model)
    for name, p in reference.state_dict().items():
        # atol: the key bias's gradient is zero up to rounding (softmax ignores it), and AdamW turns that
        # rounding noise into updates of up to lr; a missed or doubled update would differ by ~lr
        torch.testing.assert_close(params[name], p, rtol=1e-3, atol=LR / 20, msg=lambda m: f"{name}: {m}")
    attn = model.blocks[0].attn
    assert isinstance(attn, gpt.CausalSelfAttention)
    qkv, out = attn.qkv.weight, attn.out.weight
    if "tp" in dims:  # the plan's placements survive the optimizer's in-place updates
        assert isinstance(qkv, MeshTensor) and isinstance(out, MeshTensor)
        assert qkv.placements == (Replicate(), Shard(0)) and out.placements == (Replicate(), Shard(1))
