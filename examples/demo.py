"""monarch demo: one controller drives a 4-process mesh (dp=2 x tp=2) of actors, then trains a GPT on it.

Run with `make demo`. A few actor calls first; then the main act: a small GPT-style language model
(examples/gpt.py) trained data- and tensor-parallel from plain torch code, next to the same model
trained by plain single-process torch from the same seed and data. The two loss curves agree.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

import torch
from tqdm import tqdm

import monarch
from monarch.actor import Actor, ActorError, ProcMesh, current_rank, endpoint, this_host

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402

TIMEOUT = 300.0  # seconds any single wait may take


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def fail(self) -> None:
        raise ValueError(f"counter at {dict(current_rank())} refuses")


def actors(procs: ProcMesh) -> None:
    """Spawn an actor on every process, call all, call one, fire and forget, and a remote error."""
    counters = procs.spawn("counters", Counter, 0)
    print("call on all 4 ->", list(counters.incr.call(2).get(timeout=TIMEOUT).values()))
    print("call_one on dp=0,tp=1 ->", counters.slice(dp=0, tp=1).incr.call_one().get(timeout=TIMEOUT))
    counters.slice(dp=1).incr.broadcast(5)
    print("after broadcast to dp=1 ->", list(counters.incr.call(0).get(timeout=TIMEOUT).values()))
    try:
        counters.slice(dp=1, tp=1).fail.call_one().get(timeout=TIMEOUT)
    except ActorError as e:
        print(f"remote error from rank {e.rank} ({e.coords}): {str(e).splitlines()[0]}")


def train_on_mesh(procs: ProcMesh, cfg: gpt.GPTConfig, data: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """The GPT, tensor-parallel over tp and data-parallel over dp; returns every step's loss."""
    model = gpt.build(cfg, args.seed)
    monarch.parallelize_module(model, procs, gpt.tp_plan(cfg, procs.size("tp")))
    monarch.data_parallel(model, procs, dim="dp")
    print("block 0 weights over (dp, tp):", ", ".join(
        f"{name.removeprefix('blocks.0.')} {p.placements}" for name, p in model.named_parameters()
        if name.startswith("blocks.0.") and isinstance(p, monarch.MeshTensor) and p.ndim == 2))
    step = gpt.compile_step(gpt.train_step(model, gpt.optimizer(model, args.lr)), eager=args.eager)
    stream = gpt.batches(data, args.batch, cfg.context, args.seed)
    losses: list[float] = []
    pending: deque = deque()  # loss futures: step i+1 is recorded while the workers run step i
    bar = tqdm(total=args.steps, desc=f"monarch dp=2 x tp=2 {'eager' if args.eager else 'compiled'}",
               unit="step", file=sys.stdout)

    def record() -> None:
        losses.append(pending.popleft().get(timeout=TIMEOUT).item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.update()
    for _ in range(args.steps):
        x, y = next(stream)  # plain tensors: data_parallel shards the batch over dp inside the step
        pending.append(monarch.fetch(step(x, y)))
        if len(pending) > 1:
            record()
    while pending:
        record()
    bar.close()
    return losses


def train_plain(cfg: gpt.GPTConfig, data: torch.Tensor, args: argparse.Namespace) -> list[float]:
    bar = tqdm(total=args.steps, desc="plain torch, 1 process", unit="step", file=sys.stdout)

    def progress(loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()
    losses = gpt.train_torch(cfg, args.steps, args.batch, args.seed, args.lr, data, progress)
    bar.close()
    return losses


def compare(mesh: list[float], plain: list[float], every: int, tol: float) -> None:
    """Print both loss curves every `every` steps and fail unless they agree within `tol`."""
    print(f"\n{'step':>5}  {'monarch':>9}  {'torch':>9}  {'|diff|':>8}")
    for i in sorted({*range(0, len(mesh), every), len(mesh) - 1}):
        print(f"{i:>5}  {mesh[i]:>9.4f}  {plain[i]:>9.4f}  {abs(mesh[i] - plain[i]):>8.1e}")
    worst = max(abs(a - b) for a, b in zip(mesh, plain, strict=True))
    agree = worst <= tol
    print(f"loss curves agree within {tol:g}: {agree} (largest difference {worst:.1e})")
    if not agree:
        raise SystemExit(f"monarch and plain torch losses differ by {worst:.2e} > {tol:g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=10, help="print the loss curves every this many steps")
    p.add_argument("--tol", type=float, default=1e-3, help="largest allowed loss difference")
    p.add_argument("--eager", action="store_true", help="run the step op by op instead of monarch.compile")
    args = p.parse_args()
    cfg = gpt.GPTConfig()
    data = gpt.load_text()
    print(f"GPT: {gpt.n_params(gpt.build(cfg)) / 1e6:.1f}M parameters, {cfg}; "
          f"{len(data) / 1e6:.2f} MB of text from the repo")
    t0 = time.perf_counter()
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as procs:
        actors(procs)
        mesh_losses = train_on_mesh(procs, cfg, data, args)
    print(f"mesh run: {time.perf_counter() - t0:.1f} s with spawn and shutdown")
    compare(mesh_losses, train_plain(cfg, data, args), args.every, args.tol)


if __name__ == "__main__":
    main()
