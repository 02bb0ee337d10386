"""Checkpoint save and load of a dp=2 x tp=2 model with AdamW state: monarch.checkpoint against the gather way
and against plain DCP under torchrun.

For examples/gpt.py's GPT (its default GPTConfig) and an MLP of --layers nn.Linear (--width wide, ReLU between),
tensor-parallel in Colwise/Rowwise pairs over "tp" and replicated over "dp", each way in a subprocess of its own
(with a timeout), all in one run:
- monarch: mcp.save and mcp.load (+ mcp.set_state_dict) of mcp.get_state_dict(model, opt), each worker writing and
  reading its own pieces; then the time the training loop is blocked by mcp.save and by mcp.async_save (until the
  call returns, the compiled step right after it, and until fut.get() returns);
- gather: monarch.full_state_dict of the model and the optimizer on the controller, then torch.save (fsynced, as
  DCP's writer does); torch.load + load_state_dict back (measured once);
- dcp: `torchrun --standalone --nproc-per-node 4` (gloo, CPU), the same model as DTensors on a 2x2 DeviceMesh
  ("dp", "tp"), dcp.save / dcp.load of torch's get_state_dict(model, opt), timed on rank 0 between barriers.
Each save and load is the fastest of --repeats (every save to a new id); GB/s is the checkpoint's bytes on disk
(`du -sb`) over the seconds. Loads read what was just written (from the page cache).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
import gpt  # noqa: E402
from actors import machine  # noqa: E402
from train_vs_ddp import print_rows, result_of  # noqa: E402

MESH = {"dp": 2, "tp": 2}
RANKS = MESH["dp"] * MESH["tp"]
KINDS = ("monarch", "gather", "dcp")
# Workers handling the gather way's load_state_dict of a 100M-parameter model stay silent for longer than the
# default 5 s on a loaded 2-core machine; a silent worker fails its mesh, so every way runs with this timeout.
HEARTBEAT = "60"
NAMES = {"monarch": "monarch mcp.save / mcp.load", "gather": "full_state_dict + torch.save",
         "dcp": f"DCP under torchrun, {RANKS} ranks"}


# -- the models, their plans and one training step ------------------------------------------------------------
def model_of(args: argparse.Namespace) -> nn.Module:
    if args.model == "gpt":
        return gpt.build(gpt.GPTConfig(), args.seed)
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = []
    for i in range(args.layers):
        layers += [nn.Linear(args.width, args.width)] + ([nn.ReLU()] if i < args.layers - 1 else [])
    return nn.Sequential(*layers)


def styles(args: argparse.Namespace) -> dict[str, str]:
    """Submodule name -> "col" or "row": the GPT's own tp_plan, or the MLP's Linears in column/row pairs."""
    if args.model == "gpt":
        import monarch
        return {k: "col" if isinstance(v, monarch.ColwiseParallel) else "row"
                for k, v in gpt.tp_plan(gpt.GPTConfig(), MESH["tp"]).items()}
    return {str(2 * i): "row" if i % 2 else "col" for i in range(args.layers)}


def batches(args: argparse.Namespace) -> Iterator[tuple[torch.Tensor, ...]]:
    if args.model == "gpt":
        return gpt.batches(gpt.load_text(), args.batch, gpt.GPTConfig().context, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    return iter(lambda: (torch.randn(args.batch, args.width, generator=gen),), None)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> Callable[..., Any]:
    if args.model == "gpt":
        return gpt.train_step(model, opt)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def du(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True).stdout.split()[0])


def writers(path: str) -> int:
    """How many ranks wrote data: the non-empty .distcp files of a DCP checkpoint."""
    return sum(1 for f in Path(path).glob("*.distcp") if f.stat().st_size > 0)


def clock(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best(fn: Callable[[int], Any], repeats: int) -> float:
    """The least seconds of the calls fn(0), fn(1), ..., fn(repeats - 1): the one least disturbed by other load."""
    return min(clock(lambda: fn(i)) for i in range(repeats))


# -- one way, measured in this process -------------------------------------------------------------------------
def on_mesh(procs: Any, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], float]]:
    """The model on `procs` (tp plan, then data_parallel), its AdamW after one compiled step (the trace), and
    `step()`: one more compiled step, returning its seconds until the loss is known."""
    import monarch
    model = model_of(args)
    plan = {k: monarch.ColwiseParallel(dim="tp") if s == "col" else monarch.RowwiseParallel(dim="tp")
            for k, s in styles(args).items()}
    monarch.parallelize_module(model, procs, plan)
    monarch.data_parallel(model, procs, dim="dp")
    opt = gpt.optimizer(model)
    compiled, stream = monarch.compile(train_step(model, opt, args)), batches(args)

    def step() -> float:
        return clock(lambda: monarch.fetch(compiled(*next(stream))).get(timeout=args.timeout).item())
    step()  # the trace; AdamW has its state after it
    return model, opt, step


def run_monarch(args: argparse.Namespace) -> dict[str, Any]:
    import monarch
    import monarch.checkpoint as mcp
    from monarch.actor import this_host
    first, second = f"{args.dir}/save0", f"{args.dir}/async"
    with this_host().spawn_procs(per_host=MESH) as procs:
        model, opt, step = on_mesh(procs, args)
        step()  # the first replay of the compiled step
        step_s = step()
        sd = mcp.get_state_dict(model, opt)
        save_s = best(lambda i: mcp.save(sd, checkpoint_id=f"{args.dir}/save{i}", timeout=args.timeout), args.repeats)
        after_save_s = step()
        t0 = time.perf_counter()
        fut = mcp.async_save(sd, checkpoint_id=second)
        call_s = time.perf_counter() - t0
        after_async_s = step()
        fut.get(args.timeout)
        async_total_s = time.perf_counter() - t0

        def load() -> None:
            mcp.load(sd, checkpoint_id=first, timeout=args.timeout)
            mcp.set_state_dict(model, opt, sd)
            monarch.synchronize(procs, timeout=args.timeout)
        load_s = best(lambda _: load(), args.repeats)
    return {"bytes": du(first), "writers": writers(first), "save_s": save_s, "load_s": load_s, "step_s": step_s,
            "after_save_s": after_save_s, "async_call_s": call_s, "after_async_s": after_async_s,
            "async_total_s": async_total_s, "async_bytes": du(second)}


def run_gather(args: argparse.Namespace) -> dict[str, Any]:
    import monarch
    from monarch.actor import this_host
    path = f"{args.dir}/full.pt"
    with this_host().spawn_procs(per_host=MESH) as procs:
        model, opt, _ = on_mesh(procs, args)
        gather_s, save_s = min((gather_and_write(model, opt, path, args) for _ in range(args.repeats)),
                               key=lambda t: t[1])

        def load() -> None:
            got = torch.load(path)
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optim"])
            monarch.synchronize(procs, timeout=args.timeout)
        load_s = clock(load)  # once: it takes several times the other ways' loads
    return {"bytes": du(path), "writers": 1, "save_s": save_s, "gather_s": gather_s, "load_s": load_s}


def gather_and_write(model: nn.Module, opt: torch.optim.Optimizer, path: str,
                     args: argparse.Namespace) -> tuple[float, float]:
    """monarch.full_state_dict of both, then torch.save fsynced: the seconds until gathered and until written."""
    import monarch
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)  # not inside the time: a repeat writes a new file, as the other ways do
    t0 = time.perf_counter()
    full = {"model": monarch.full_state_dict(model, args.timeout), "optim": monarch.full_state_dict(opt, args.timeout)}
    gathered = time.perf_counter() - t0
    with open(path, "wb") as f:
        torch.save(full, f)
        f.flush()
        os.fsync(f.fileno())
    return gathered, time.perf_counter() - t0


def run_dcp(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank of the torchrun job (rank 0 returns the numbers); gradients of one AdamW step are set, not
    computed: the checkpoint holds the same tensors either way."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh("cpu", (MESH["dp"], MESH["tp"]), mesh_dim_names=("dp", "tp"))
        model = model_of(args)
        parallelize_module(model, mesh["tp"], {k: ColwiseParallel() if s == "col" else RowwiseParallel()
                                               for k, s in styles(args).items()})
        opt = gpt.optimizer(model)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}

        first = f"{args.dir}/save0"

        def between_barriers(fn: Callable[[int], Any]) -> float:
            """The least seconds of --repeats calls fn(i) on every rank, each from a barrier to a barrier."""
            def once(i: int) -> float:
                dist.barrier()
                return clock(lambda: (fn(i), dist.barrier()))
            return min(once(i) for i in range(args.repeats))
        save_s = between_barriers(lambda i: dcp.save(sd, checkpoint_id=f"{args.dir}/save{i}"))
        load_s = between_barriers(lambda _: (dcp.load(sd, checkpoint_id=first), set_state_dict(
            model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])))
        if dist.get_rank() == 0:
            return {"bytes": du(first), "writers": writers(first), "save_s": save_s, "load_s": load_s}
        return None
    finally:
        dist.destroy_process_group()


def run_one(args: argparse.Namespace) -> None:
    import json
    got = {"monarch": run_monarch, "gather": run_gather, "dcp": run_dcp}[args.one](args)
    if got is not None:
        print("RESULT " + json.dumps(got), flush=True)


# -- the driver: each way in a subprocess with a timeout -------------------------------------------------------
def command(kind: str, model: str, args: argparse.Namespace, out: str) -> list[str]:
    own = [str(Path(__file__).resolve()), "--one", kind, "--model", model, "--dir", out]
    for knob in ("width", "layers", "repeats", "batch", "seed", "timeout"):
        own += [f"--{knob}", str(getattr(args, knob))]
    if kind == "dcp":
        return [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={RANKS}", *own]
    return [sys.executable, *own]


def measure(kind: str, model: str, args: argparse.Namespace, tmp: str) -> dict[str, Any] | str:
    """The way's numbers, or why there are none; what it wrote is removed before the next way runs."""
    out = os.path.join(tmp, f"{model}-{kind}")
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // RANKS))}
    env.pop("MONARCH_STRICT", None)
    env.setdefault("MONARCH_HEARTBEAT_TIMEOUT", HEARTBEAT)
    try:
        return result_of(command(kind, model, args, out), env, args.timeout, f"{kind} {model}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def n_params(model: str, args: argparse.Namespace) -> int:
    return sum(p.numel() for p in model_of(argparse.Namespace(**{**vars(args), "model": model})).parameters())


def check_disk(args: argparse.Namespace, params: dict[str, int]) -> None:
    """Refuse to start unless /tmp holds the largest way's files (monarch: --repeats + 1 checkpoints of the weights
    and AdamW's two moments, 3 x 4 bytes per parameter each) with room to spare."""
    need = (args.repeats + 1) * 12 * max(params.values())
    free = shutil.disk_usage(tempfile.gettempdir()).free
    print(f"disk: {free / 1e9:.1f} GB free in {tempfile.gettempdir()}; the largest way writes up to "
          f"{need / 1e9:.2f} GB at once (removed after each way)")
    if free < 2 * need:
        raise SystemExit(f"not enough free disk space in {tempfile.gettempdir()}: {free / 1e9:.1f} GB free, want "
                         f"{2 * need / 1e9:.1f} GB")


def size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def secs(s: float) -> str:
    return f"{s:.3f} s" if s < 10 else f"{s:.1f} s"


def rate(n: int, s: float) -> str:
    return f"{n / s / 1e9:.2f}"


def speed_rows(model: str, got: dict[str, dict[str, Any] | str]) -> list[tuple[str, ...]]:
    rows = []
    for kind in KINDS:
        r = got[kind]
        if isinstance(r, str):
            rows.append((model, NAMES[kind], "failed", "", "", "", "", ""))
            continue
        save = secs(r["save_s"]) + (f" (gather {secs(r['gather_s'])})" if "gather_s" in r else "")
        rows.append((model, NAMES[kind], size(r["bytes"]), str(r["writers"]), save, rate(r["bytes"], r["save_s"]),
                     secs(r["load_s"]), rate(r["bytes"], r["load_s"])))
    return rows


def ratios(model: str, got: dict[str, dict[str, Any] | str]) -> list[str]:
    mon = got["monarch"]
    if isinstance(mon, str):
        return []
    lines = []
    for kind, aim in (("dcp", "aim >= 1"), ("gather", f"aim >= {mon['writers']}, the ranks writing")):
        other = got[kind]
        if not isinstance(other, str):
            lines.append(f"{model}: monarch save {other['save_s'] / mon['save_s']:.2f}x as fast as {NAMES[kind]} "
                         f"({aim}); load {other['load_s'] / mon['load_s']:.2f}x")
    return lines


def blocked_rows(model: str, r: dict[str, Any] | str) -> list[tuple[str, ...]]:
    if isinstance(r, str):
        return [(model, "", "failed", "", "", "", "")]
    return [(model, "mcp.save", secs(r["save_s"]), secs(r["after_save_s"]), secs(r["save_s"]), secs(r["step_s"]),
             size(r["bytes"])),
            (model, "mcp.async_save", secs(r["async_call_s"]), secs(r["after_async_s"]), secs(r["async_total_s"]),
             secs(r["step_s"]), size(r["async_bytes"]))]


def report(results: dict[str, dict[str, dict[str, Any] | str]]) -> None:
    rows: list[tuple[str, ...]] = [("model", "way", "on disk", "writers", "save", "GB/s", "load", "GB/s")]
    for model, got in results.items():
        rows += speed_rows(model, got)
    print_rows(rows)
    print()
    for model, got in results.items():
        print("\n".join(ratios(model, got)))
    print("\ntraining blocked by a save (compiled steps, each until its loss is known)")
    rows = [("model", "call", "call returns", "step right after", "until saved", "a step without save", "on disk")]
    for model, got in results.items():
        rows += blocked_rows(model, got["monarch"])
    print_rows(rows)
    for model, got in results.items():
        for kind, r in got.items():
            if isinstance(r, str):
                print(f"{model}, {NAMES[kind]} failed: {r}")


def print_machine(args: argparse.Namespace, params: dict[str, int]) -> None:
    print(f"monarch checkpoint, {datetime.date.today().isoformat()}, {'quick' if args.quick else 'full'} run")
    print(machine())
    shapes = {"gpt": f"{gpt.GPTConfig()}", "mlp": f"{args.layers} x Linear({args.width}, {args.width}), ReLU between"}
    for model in args.models:
        print(f"{model}: {params[model] / 1e6:.2f}M parameters ({shapes[model]}); AdamW; the checkpoint holds the "
              "model and the optimizer")
    heartbeat = os.environ.get("MONARCH_HEARTBEAT_TIMEOUT", HEARTBEAT)
    print(f"mesh dp={MESH['dp']} x tp={MESH['tp']}; tp plan in Colwise/Rowwise pairs, replicated over dp; "
          f"MONARCH_HEARTBEAT_TIMEOUT={heartbeat}; saves and loads the fastest of {args.repeats}", flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the GPT only (default), and a ~20M-parameter MLP if asked")
    p.add_argument("--models", nargs="+", choices=["gpt", "mlp"], help="default: gpt mlp (quick: gpt)")
    p.add_argument("--width", type=int, help="MLP width (default 4096: 100.7M parameters; quick 1792: 19.3M)")
    p.add_argument("--layers", type=int, default=6, help="MLP Linear layers, an even number (default 6)")
    p.add_argument("--repeats", type=int, help="saves and loads per way, the fastest kept (default 2, quick 1)")
    p.add_argument("--batch", type=int, default=16, help="batch of the training steps (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess (default 300)")
    p.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.models = args.models or (["gpt"] if args.quick else ["gpt", "mlp"])
    args.width = args.width or (1792 if args.quick else 4096)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.layers % 2:
        p.error(f"--layers {args.layers}: the MLP's Linears go in column/row pairs, give an even number")
    return args


def main() -> None:
    args = parse()
    if args.one:
        run_one(args)
        return
    t0 = time.perf_counter()
    params = {model: n_params(model, args) for model in args.models}
    print_machine(args, params)
    check_disk(args, params)
    print()
    with tempfile.TemporaryDirectory(prefix="monarch-checkpoint-") as tmp:
        results = {model: {kind: measure(kind, model, args, tmp) for kind in KINDS} for model in args.models}
    report(results)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
