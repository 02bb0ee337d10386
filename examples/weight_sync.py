"""RL-style weight sync: a trainer mesh trains the GPT (examples/gpt.py) data parallel, and after every round
its weights move to a separate generator mesh with `to_mesh`, rank to rank (never through the controller),
where the generator samples greedily with the fresh weights. The samples and weights equal plain torch's.

    python examples/weight_sync.py [rounds]
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402 - the example's model, next to this file

import monarch  # noqa: E402
from monarch import Shard  # noqa: E402
from monarch.actor import ProcMesh, this_host  # noqa: E402


def greedy(model: nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    """`n` next bytes after `prompt` (1, t), each the most likely one."""
    idx = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(idx[:, -model.cfg.context:])[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt.full_tensor() if isinstance(nxt, monarch.MeshTensor) else nxt], 1)
    return idx[0, prompt.shape[1]:].tolist()


def sync(trainer: nn.Module, generator: nn.Module, mesh: ProcMesh) -> None:
    """The generator's parameters become the trainer's, moved from the trainer's ranks to the generator's."""
    with torch.no_grad():
        for mine, theirs in zip(generator.parameters(), trainer.parameters(), strict=True):
            mine.data = theirs.detach().to_mesh(mesh, mine.placements)


def run(cfg: gpt.GPTConfig, rounds: int, steps: int, data: torch.Tensor, on_mesh: bool = True,
        batch: int = 8, seed: int = 0) -> list[list[int]]:
    """Each round: `steps` training steps, a weight sync, 8 greedy bytes from the generator."""
    model = gpt.build(cfg, seed)
    prompt = data[:16].view(1, -1)
    stream = gpt.batches(data, batch, cfg.context, seed)
    if not on_mesh:
        step = gpt.train_step(model, gpt.optimizer(model))
        out = []
        for _ in range(rounds):
            for _ in range(steps):
                step(*next(stream))
            out.append(greedy(model, prompt, 8))
        return out
    with this_host().spawn_procs(per_host={"dp": 2}) as train_mesh, \
            this_host().spawn_procs(per_host={"gen": 2}) as gen_mesh:
        trainer = monarch.parallelize_module(copy.deepcopy(model), train_mesh, {})
        generator = monarch.parallelize_module(copy.deepcopy(model), gen_mesh, {})
        step = monarch.compile(gpt.train_step(trainer, gpt.optimizer(trainer)))
        out = []
        for _ in range(rounds):
            for _ in range(steps):
                x, y = next(stream)
                step(monarch.distribute_tensor(x, train_mesh, {"dp": Shard(0)}),
                     monarch.distribute_tensor(y, train_mesh, {"dp": Shard(0)}))
            sync(trainer, generator, gen_mesh)
            out.append(greedy(generator, monarch.distribute_tensor(prompt, gen_mesh), 8))
        return out


def main(rounds: int) -> None:
    cfg = gpt.GPTConfig(d_model=64, n_layer=2, n_head=4, context=32)
    data = gpt.load_text()
    mesh, plain = run(cfg, rounds, 3, data), run(cfg, rounds, 3, data, on_mesh=False)
    for i, (m, p) in enumerate(zip(mesh, plain, strict=True)):
        print(f"round {i}: generator mesh {bytes(m)!r}   plain torch {bytes(p)!r}")
    assert mesh == plain, "the generator's samples differ from plain torch's"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
