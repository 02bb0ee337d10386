"""GPU check (one GPU, under 5 minutes): CUDA meshes against plain torch on the same GPU, in one run.

1. plain torch: the GPT example (examples/gpt.py) trained --steps steps on the GPU: the baseline losses and
   median step time.
2. a 1-process CUDA mesh: the same model and data, `data_parallel` over its one process, eager and compiled:
   the largest loss difference from the baseline (GPU kernels: agreement within 1e-3 relative is expected),
   median step times as a ratio to plain torch, and the memory table's CUDA columns.
3. a 2-process mesh sharing the GPU (MONARCH_SHARE_GPUS=1), dp=2 compiled: first with NCCL
   (MONARCH_COLLECTIVES=torch; NCCL refuses two ranks on one GPU unless configured, and what it says is
   printed), then through pinned host memory (MONARCH_COLLECTIVES=auto stages CUDA collectives there).
4. a 1 GiB `to_mesh` between two 1-process CUDA meshes on the GPU (staged through host memory), against one
   device-to-host copy of 1 GiB in the controller (the least staging costs).

The workers need a CUDA build of torch (the controller does not). `--device cpu` runs the same parts on CPU
meshes (a dry run of the script where no GPU is). Every part reports its outcome; a failing
part prints its error and the run goes on. Run: `python benchmarks/gpu_check.py [--steps N]`.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import monarch
from monarch.actor import ProcMesh, this_host

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402 - the example model, shared with the demo and the tests

T = 240.0
DEVICE = ["cuda"]  # --device cpu runs every part on CPU meshes: a dry run of this script where no GPU is
ROWS: list[tuple[str, str, str]] = []  # (part, result, note)


def machine() -> str:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip() if _has_smi() else ""
    return (f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), GPUs: {gpus or 'none that nvidia-smi lists'}")


def _has_smi() -> bool:
    return any(Path(d, "nvidia-smi").exists() for d in os.environ.get("PATH", "").split(os.pathsep))


def part(name: str, fn: Callable[[], str]) -> None:
    """Run one part; its one-line outcome (or its error) goes into the report."""
    start = time.monotonic()
    try:
        ROWS.append((name, fn(), f"{time.monotonic() - start:.0f} s"))
    except Exception as e:  # noqa: BLE001 - the report shows every part's failure
        traceback.print_exc(limit=-3)
        ROWS.append((name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", ""))


def plain(cfg: gpt.GPTConfig, args: argparse.Namespace, data: torch.Tensor) -> tuple[list[float], float]:
    """Plain torch on the device the meshes use: every step's loss and the median step time."""
    model = gpt.build(cfg, args.seed).to(DEVICE[0])
    step = gpt.train_step(model, gpt.optimizer(model))
    stream = gpt.batches(data, args.batch, cfg.context, args.seed)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = (t.to(DEVICE[0]) for t in next(stream))
        t0 = time.perf_counter()
        losses.append(step(x, y).item())  # item() waits for the GPU
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[2:])


def on_mesh(procs: ProcMesh, dim: str, cfg: gpt.GPTConfig, args: argparse.Namespace, data: torch.Tensor,
            eager: bool) -> tuple[list[float], float]:
    """The same training on a mesh, data-parallel over `dim`: every step's loss and the median step time."""
    model = gpt.build(cfg, args.seed)
    monarch.data_parallel(model, procs, dim=dim)
    step = gpt.compile_step(gpt.train_step(model, gpt.optimizer(model)), eager=eager)
    stream = gpt.batches(data, args.batch, cfg.context, args.seed)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = next(stream)
        t0 = time.perf_counter()
        losses.append(step(x, y).item())
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[2:])


def agreement(losses: list[float], base: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True))


def one_process(cfg: gpt.GPTConfig, args: argparse.Namespace, data: torch.Tensor, base: tuple[list[float], float]
                ) -> str:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, device=DEVICE[0])
    try:
        for eager in (True, False):
            def run(eager: bool = eager) -> str:
                losses, took = on_mesh(procs, "gpus", cfg, args, data, eager)
                return (f"max rel. loss diff {agreement(losses, base[0]):.1e}; step {took * 1e3:.1f} ms = "
                        f"{took / base[1]:.2f}x plain torch's {base[1] * 1e3:.1f} ms")
            part(f"1-process CUDA mesh, {'eager' if eager else 'compiled'}", run)
        part("memory table, CUDA columns (max)", lambda: ", ".join(
            f"{k} {v / (1 << 20):.0f} MiB" for k, v in zip(
                ("allocated", "reserved", "peak"),
                procs.sql("SELECT max(cuda_allocated_bytes), max(cuda_reserved_bytes), max(cuda_peak_bytes) "
                          "FROM memory")[0], strict=True)))
    finally:
        procs.stop().get(T)
    return "done (rows above)"


def shared_gpu(cfg: gpt.GPTConfig, args: argparse.Namespace, data: torch.Tensor, base: tuple[list[float], float]
               ) -> str:
    os.environ["MONARCH_SHARE_GPUS"] = "1"
    for collectives in ("torch", "auto"):
        def run(collectives: str = collectives) -> str:
            procs = this_host().spawn_procs(per_host={"dp": 2}, device=DEVICE[0],
                                            env={"MONARCH_COLLECTIVES": collectives})
            try:
                losses, took = on_mesh(procs, "dp", cfg, args, data, eager=False)
                kinds = procs.sql(f"SELECT DISTINCT transport FROM collectives WHERE mesh = '{procs.name}'")
                return (f"max rel. loss diff {agreement(losses, base[0]):.1e}; step {took * 1e3:.1f} ms = "
                        f"{took / base[1]:.2f}x plain torch; collectives on {sorted(k for (k,) in kinds)}")
            finally:
                procs.stop().get(T)
        part(f"2 processes on one GPU, dp=2 compiled, MONARCH_COLLECTIVES={collectives}", run)
    return "done (rows above)"


def to_mesh_gib() -> str:
    os.environ["MONARCH_HEARTBEAT_TIMEOUT"] = "60"  # the controller's: a 1 GiB kernel may hold a worker's GIL
    a = this_host().spawn_procs(per_host={"gpus": 1}, device=DEVICE[0])
    b = this_host().spawn_procs(per_host={"gpus": 1}, device=DEVICE[0])
    try:
        t = monarch.arange(1 << 28, mesh=a, dtype=torch.float32).remainder_(7)  # 1 GiB of float32
        moved = [t.to_mesh(b)]
        monarch.synchronize()
        took = []
        for _ in range(3):
            t0 = time.perf_counter()
            moved.append(t.to_mesh(b))
            monarch.synchronize(b)
            took.append(time.perf_counter() - t0)
        same = moved[-1].sum().item() == t.sum().item()
        local = torch.ones(1 << 28, device=DEVICE[0])
        copies = []
        for _ in range(3):
            t0 = time.perf_counter()
            local.cpu() if local.is_cuda else local.clone()  # one copy to the host: what staging costs at least
            copies.append(time.perf_counter() - t0)
        fast, copy = statistics.median(took), statistics.median(copies)
        return (f"to_mesh {fast * 1e3:.0f} ms ({(1 << 30) / fast / 1e9:.2f} GB/s), device {moved[-1].device}, "
                f"sums agree: {same}; one {DEVICE[0]}-to-host copy here {copy * 1e3:.0f} ms ({fast / copy:.1f}x)")
    finally:
        a.stop().get(T)
        b.stop().get(T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run on CPU meshes")
    args = p.parse_args()
    DEVICE[0] = args.device
    print(f"machine: {machine()}\n", flush=True)
    cfg, data = gpt.GPTConfig(), gpt.load_text()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("this controller's torch has no CUDA: plain torch on the GPU (the baseline) cannot run here; run this "
              "script with a CUDA build of torch", flush=True)
        return
    base = plain(cfg, args, data)
    ROWS.append((f"plain torch on {args.device}", f"step {base[1] * 1e3:.1f} ms, final loss {base[0][-1]:.4f}", ""))
    part("1-process CUDA mesh", lambda: one_process(cfg, args, data, base))
    part("2 processes on one GPU", lambda: shared_gpu(cfg, args, data, base))
    part("1 GiB to_mesh between two 1-process CUDA meshes", to_mesh_gib)
    width = max(len(r[0]) for r in ROWS)
    print("\n" + "\n".join(f"{name:<{width}}  {result}  {note}" for name, result, note in ROWS))


if __name__ == "__main__":
    main()
