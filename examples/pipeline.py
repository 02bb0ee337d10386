"""Two-stage pipeline-parallel training of the GPT (examples/gpt.py) on two sub-meshes of one proc mesh.

The model is cut in two: stage 0 (embeddings and the first half of the blocks) lives on `procs.slice(stage=0)`,
stage 1 (the other blocks, the final norm and the head) on `procs.slice(stage=1)`; each stage is data parallel
over its own `dp` dim. Every step runs GPipe microbatches: each microbatch's activations move from stage 0's
ranks to stage 1's with `to_mesh` (never through the controller), and the backward pass sends their gradients
back the same way. The step is compiled (`monarch.compile`): one program per stage, both running at once, each
waiting only for the pieces it needs, so stage 0 computes the next microbatch while stage 1 takes the last.
The losses equal plain torch's on the whole model.

    python examples/pipeline.py [steps]
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402 - the example's model, next to this file

import monarch  # noqa: E402
from monarch import Shard  # noqa: E402
from monarch.actor import ProcMesh, this_host  # noqa: E402


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


def gpipe(stages: tuple[nn.Module, nn.Module], opts: list[torch.optim.Optimizer], micro: int,
          second: ProcMesh | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One GPipe step on a batch laid out as (micro, batch / micro, context): every microbatch forward
    (its activations moved to `second`, stage 1's mesh, when given), the mean loss backward, then each stage's
    optimizer. Returns the loss."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses = []
        for i in range(micro):
            h = stages[0](x[i])
            if second is not None:
                h = h.to_mesh(second, {"dp": Shard(0)})
            losses.append(gpt.lm_loss(stages[1](h), y[i]))
        loss = sum(losses) / micro
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return loss
    return step


def train(cfg: gpt.GPTConfig, steps: int, data: torch.Tensor, batch: int = 8, micro: int = 4, seed: int = 0,
          on_mesh: bool = True, eager: bool = False) -> list[float]:
    """The losses of `steps` pipeline steps on `data`, on a 2-stage x dp=2 mesh (compiled, or `eager`), or
    (on_mesh=False) in plain torch."""
    model = gpt.build(cfg, seed)
    cut = cfg.n_layer // 2
    stages = (Stage0(model, cut), Stage1(model, cut))
    stream = gpt.batches(data, batch, cfg.context, seed)
    if not on_mesh:
        step = gpipe(stages, [gpt.optimizer(s) for s in stages], micro)
        return [step(*(t.view(micro, -1, cfg.context) for t in next(stream))).item() for _ in range(steps)]
    with this_host().spawn_procs(per_host={"stage": 2, "dp": 2}) as procs:
        first, second = procs.slice(stage=0), procs.slice(stage=1)
        sharded = (monarch.parallelize_module(stages[0], first, {}), monarch.parallelize_module(stages[1], second, {}))
        step = gpt.compile_step(gpipe(sharded, [gpt.optimizer(s) for s in sharded], micro, second), eager)
        losses = []
        for _ in range(steps):  # each microbatch's rows split over dp
            x, y = (t.view(micro, -1, cfg.context) for t in next(stream))
            losses.append(step(monarch.distribute_tensor(x, first, {"dp": Shard(1)}),
                               monarch.distribute_tensor(y, second, {"dp": Shard(1)})).item())
        return losses


def main(steps: int) -> None:
    cfg = gpt.GPTConfig(d_model=64, n_layer=2, n_head=4, context=32)
    data = gpt.load_text()
    mesh, plain = train(cfg, steps, data), train(cfg, steps, data, on_mesh=False)
    for i, (m, p) in enumerate(zip(mesh, plain, strict=True)):
        print(f"step {i}: compiled pipeline on 2 stages x dp=2 {m:.5f}   plain torch {p:.5f}")
    assert all(abs(m - p) < 1e-4 for m, p in zip(mesh, plain, strict=True)), "the pipeline diverged from torch"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
