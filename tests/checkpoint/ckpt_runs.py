"""A small model trained on a mesh or in plain torch, and the resume check shared by the checkpoint tests.

The model (embedding, a column- then row-parallel pair, dropout, a norm) has a tensor-parallel plan,
trains data-parallel over "dp", and draws from monarch.manual_seed's stream in its dropout; AdamW gives
it optimizer state. `resume` trains K steps, saves, trains on (the uninterrupted losses), then builds
a fresh model and optimizer on another mesh, loads and trains the same steps again.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import monarch
import monarch.checkpoint as mcp
from monarch import MeshTensor

T = 60.0  # seconds any single wait may take
VOCAB, WIDTH, BATCH, SEQ = 32, 16, 4, 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.drop(self.down(torch.relu(self.up(h))))
        return self.head(self.norm(h))


def build(mesh: Any | None, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (weights from `seed`) placed on `mesh` (plain when None), and its AdamW."""
    torch.manual_seed(seed)
    model = Net()
    if mesh is not None:
        dims = mesh.extent
        if "dp" in dims:
            monarch.data_parallel(model, mesh)
        plan = {"up": monarch.ColwiseParallel(dim="tp"), "down": monarch.RowwiseParallel(dim="tp")} \
            if "tp" in dims else {}
        monarch.parallelize_module(model, mesh, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(n)]


def stepper(model: nn.Module, opt: torch.optim.Optimizer, compiled: bool) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return monarch.compile(step) if compiled else step


def losses(step: Callable[..., torch.Tensor], data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    out = []
    for x, y in data:
        loss = step(x, y)
        out.append((loss.full_tensor(timeout=T) if isinstance(loss, MeshTensor) else loss).item())
    return out


def state(model: nn.Module, opt: torch.optim.Optimizer, mesh: Any, step: int) -> dict[str, Any]:
    return mcp.get_state_dict(model, opt) | {"step": step, "rng": mcp.RNGState(mesh)}


def resume(mesh: Any, others: list[Any], path: Path, compiled: bool, k: int = 2, n: int = 3) -> None:
    """Train k steps on `mesh` and save; train n more (the uninterrupted losses); then, on each mesh of
    `others`, a fresh model and optimizer load the checkpoint and train the same n steps: same losses.
    Last, the first model loads it in place and its (compiled) step trains the n steps again."""
    monarch.manual_seed(7)
    data = batches(k + n)
    model, opt = build(mesh)
    step = stepper(model, opt, compiled)
    losses(step, data[:k])
    mcp.save(state(model, opt, mesh, k), checkpoint_id=path, timeout=T)
    want = losses(step, data[k:])
    for other in others:
        fresh, fresh_opt = build(other, seed=3)
        sd = state(fresh, fresh_opt, other, 0)
        mcp.load(sd, checkpoint_id=path, timeout=T)
        mcp.set_state_dict(fresh, fresh_opt, sd)
        assert sd["step"] == k
        got = losses(stepper(fresh, fresh_opt, compiled), data[k:])
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), f"on {other!r}: {got} != {want}"
    sd = state(model, opt, mesh, 0)
    mcp.load(sd, checkpoint_id=path, timeout=T)
    mcp.set_state_dict(model, opt, sd)
    assert losses(step, data[k:]) == want


def plain_values(obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
    return monarch.full_state_dict(obj, timeout=T)
