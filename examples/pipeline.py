"""Two-stage pipeline-parallel training of the GPT (examples/gpt.py) on two sub-meshes of one proc mesh.

The model is cut in two: stage 0 (embeddings and the first half of the blocks) lives on `procs.slice(stage=0)`,
stage 1 (the other blocks, the final norm and the head) on `procs.slice(stage=1)`; each stage is data parallel
over its own `dp` dim. Every step runs GPipe microbatches: each microbatch's activations move from stage 0's
ranks to stage 1's with `to_mesh` (never through the controller), and the backward pass sends their gradients
back the same way. The losses equal plain torch's on the whole model.

    python examples/pipeline.py [steps]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402 - the example's model, next to this file

import monarch  # noqa: E402
from monarch import Shard  # noqa: E402
from monarch.actor import this_host  # noqa: E402


class Stage0(nn.Module):
    def __init__(self, model: gpt.GPT, cut: int) -> None:
        super().__init__()
        self.tok, self.pos, self.blocks = model.tok, model.pos, nn.ModuleList(model.blocks[:cut])
        self.register_buffer("positions", model.positions, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return x


class Stage1(nn.Module):
    def __init__(self, model: gpt.GPT, cut: int) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.head = nn.ModuleList(model.blocks[cut:]), model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def step_losses(stages: tuple[nn.Module, nn.Module], opts: list[torch.optim.Optimizer],
                batch: tuple[torch.Tensor, torch.Tensor], micro: int, place: tuple | None = None) -> float:
    """One GPipe step: every microbatch forward (activations moved between stages when `place` names the two
    meshes), the mean loss backward, then each stage's optimizer. Returns the step's loss."""
    x, y = batch
    losses = []
    for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
        if place is not None:
            first, second = place
            xs = monarch.distribute_tensor(xs, first, {"dp": Shard(0)})
            ys = monarch.distribute_tensor(ys, second, {"dp": Shard(0)})
        h = stages[0](xs)
        if place is not None:
            h = h.to_mesh(place[1], {"dp": Shard(0)})
        losses.append(gpt.lm_loss(stages[1](h), ys))
    loss = sum(losses) / micro
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return loss.item()


def train(cfg: gpt.GPTConfig, steps: int, data: torch.Tensor, batch: int = 8, micro: int = 4, seed: int = 0,
          on_mesh: bool = True) -> list[float]:
    """The losses of `steps` pipeline steps on `data`, on a 2-stage x dp=2 mesh or (on_mesh=False) in plain
    torch."""
    model = gpt.build(cfg, seed)
    cut = cfg.n_layer // 2
    stages = (Stage0(model, cut), Stage1(model, cut))
    stream = gpt.batches(data, batch, cfg.context, seed)
    if not on_mesh:
        opts = [gpt.optimizer(s) for s in stages]
        return [step_losses(stages, opts, next(stream), micro) for _ in range(steps)]
    with this_host().spawn_procs(per_host={"stage": 2, "dp": 2}) as procs:
        place = (procs.slice(stage=0), procs.slice(stage=1))
        sharded = tuple(monarch.parallelize_module(s, p, {}) for s, p in zip(stages, place, strict=True))
        opts = [gpt.optimizer(s) for s in sharded]
        return [step_losses(sharded, opts, next(stream), micro, place) for _ in range(steps)]


def main(steps: int) -> None:
    cfg = gpt.GPTConfig(d_model=64, n_layer=2, n_head=4, context=32)
    data = gpt.load_text()
    mesh, plain = train(cfg, steps, data), train(cfg, steps, data, on_mesh=False)
    for i, (m, p) in enumerate(zip(mesh, plain, strict=True)):
        print(f"step {i}: pipeline on 2 stages x dp=2 {m:.5f}   plain torch {p:.5f}")
    assert all(abs(m - p) < 1e-4 for m, p in zip(mesh, plain, strict=True)), "the pipeline diverged from torch"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
