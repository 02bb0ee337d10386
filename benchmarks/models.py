"""Training step time of every zoo model (examples/zoo.py): monarch compiled against torchrun + DDP, and fallbacks.

For each model, in the same run and each in a subprocess of its own (with a timeout), the mean step time
over --steps SGD steps after --warmup warm-up steps of:
- ddp: `torchrun --nproc-per-node W` + DistributedDataParallel (gloo, CPU), each rank on its slice of the
  global batch with cores / W intra-op threads;
- compiled: monarch on a dp=W mesh (monarch.data_parallel), the step under monarch.compile, MONARCH_STRICT
  unset; `fallbacks` counts the op decisions that found no sharding rule and gathered (zero is the aim).
  Weight updates are sharded as MONARCH_SHARD_UPDATE says (default auto).
`RSS/rank` is rank 0's resident memory after the steps (monarch: the largest of its worker's samples),
`optim/rank` the bytes of optimizer state rank 0 holds.
The ratio is DDP's step time over monarch's (above 1: monarch is faster). Run with --help for the knobs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
import zoo  # noqa: E402
from actors import machine  # noqa: E402
from train_vs_ddp import mib, optim_bytes, print_rows, result_of, rss, timed  # noqa: E402


@dataclass(frozen=True)
class Measured:
    step_s: float                  # mean wall time per step
    loss: float                    # global loss of the last step
    ctl_s: float | None = None     # the controller's CPU time per step call (monarch only)
    fallbacks: dict[str, int] = field(default_factory=dict)  # op name -> decisions that gathered (monarch only)
    collectives: dict[str, int] = field(default_factory=dict)  # kind[dim] -> how many one step runs (monarch only)
    rss_bytes: int = 0             # rank 0's resident memory
    optim_bytes: int = 0           # optimizer state rank 0 holds


def size(args: argparse.Namespace) -> zoo.Size:
    return zoo.Size(batch=args.batch, seq=args.seq, width=args.width, layers=args.layers, image=args.image)


def model_and_data(args: argparse.Namespace) -> tuple[zoo.Model, torch.nn.Module, list[zoo.Batch]]:
    entry = zoo.ZOO[args.model]
    torch.manual_seed(args.seed)
    return entry, entry.build(size(args)), entry.data(size(args), args.warmup + args.steps, args.seed)


# -- one configuration, measured in this process ----------------------------------------------------------
def run_ddp(args: argparse.Namespace) -> Measured:
    """One rank of a torchrun job: its slice of every global batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    entry, model, data = model_and_data(args)
    ddp = DistributedDataParallel(model)
    opt = zoo.optimizer(ddp)
    step = zoo.train_step(ddp, opt, entry.loss)
    per = args.batch // world
    mine = iter([tuple(t[rank * per:(rank + 1) * per] for t in batch) for batch in data])

    def sync(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world
    try:
        r = timed(step, mine, sync, args.warmup, args.steps, dist.barrier)
        return Measured(r.step_s, r.loss, rss_bytes=rss(), optim_bytes=optim_bytes(opt))
    finally:
        dist.destroy_process_group()


def run_compiled(args: argparse.Namespace) -> Measured:
    """monarch on a dp=--world mesh; then one more step counts the collectives a step runs."""
    import monarch
    from monarch.actor import this_host
    from monarch.graph.propagate import fallback_counts
    from monarch.runtime.session.session import session_of
    entry, model, data = model_and_data(args)

    def sync(loss: torch.Tensor) -> float:
        return monarch.fetch(loss).get(timeout=args.timeout).item()
    with this_host().spawn_procs(per_host={"dp": args.world}) as procs:
        model = monarch.data_parallel(model, procs)
        opt = zoo.optimizer(model)
        step = monarch.compile(zoo.train_step(model, opt, entry.loss))
        r = timed(step, iter(data), sync, args.warmup, args.steps)
        shipped = session_of(procs).collectives
        before = len(shipped)
        sync(step(*data[-1]))
        comms = Counter(shipped[before:])
        ((peak,),) = procs.sql("SELECT max(rss_bytes) FROM memory WHERE rank = 0")
    return Measured(r.step_s, r.loss, r.ctl_s, fallback_counts(), dict(comms), peak, optim_bytes(opt))


def run_one(args: argparse.Namespace) -> None:
    result = run_ddp(args) if args.one == "ddp" else run_compiled(args)
    if args.one != "ddp" or int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(asdict(result)), flush=True)


# -- the driver: each configuration in a subprocess with a timeout ---------------------------------------------
KNOBS = ("steps", "warmup", "batch", "seq", "width", "layers", "image", "seed", "timeout", "world")


def command(kind: str, model: str, args: argparse.Namespace) -> list[str]:
    common = [str(Path(__file__).resolve()), "--one", kind, "--model", model]
    for knob in KNOBS:
        common += [f"--{knob}", str(getattr(args, knob))]
    if kind == "ddp":
        return [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.world}",
                *common]
    return [sys.executable, *common]


def measure(kind: str, model: str, args: argparse.Namespace) -> Measured | str:
    """The configuration's result, or why there is none."""
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_STRICT"}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.world))
    got = result_of(command(kind, model, args), env, args.timeout, f"{kind} {model}")
    return got if isinstance(got, str) else Measured(**got)


def best(kind: str, name: str, args: argparse.Namespace) -> Measured | str:
    """The fastest of --rounds measurements (the least disturbed by other load), or why there is none."""
    results = [measure(kind, name, args) for _ in range(args.rounds)]
    done = [r for r in results if isinstance(r, Measured)]
    return min(done, key=lambda r: r.step_s) if done else str(results[0])


def row(name: str, args: argparse.Namespace) -> tuple[str, ...]:
    torch.manual_seed(args.seed)
    params = sum(p.numel() for p in zoo.ZOO[name].build(size(args)).parameters())
    ddp, mon = best("ddp", name, args), best("compiled", name, args)
    cells = [name, f"{params / 1e3:,.1f}k"]
    for r in (ddp, mon):
        cells.append(r if isinstance(r, str) else f"{r.step_s * 1e3:,.2f} ms")
    if isinstance(ddp, str) or isinstance(mon, str):
        return (*cells, *[""] * 8)
    return (*cells, f"{ddp.step_s / mon.step_s:.2f}x", f"{(mon.ctl_s or 0) * 1e6:,.0f} µs",
            f"{ddp.loss:.4f} / {mon.loss:.4f}", listed(mon.collectives), f"{mib(ddp.rss_bytes)} / {mib(mon.rss_bytes)}",
            f"{mib(ddp.optim_bytes)} / {mib(mon.optim_bytes)}", str(sum(mon.fallbacks.values())),
            listed(mon.fallbacks))


def listed(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "-"


def print_machine(args: argparse.Namespace) -> None:
    print(f"monarch models, {datetime.date.today().isoformat()}")
    print(machine())
    print(f"sizes: {size(args)}; SGD with momentum; world {args.world}; {args.warmup} warm-up + {args.steps} "
          f"timed steps per configuration, the fastest of {args.rounds} run(s)\n", flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(zoo.ZOO), default=list(zoo.ZOO), help="default: all")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, incl. compile's trace (default 3)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sample (default 32)")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="encoder and GPT layers (default 2)")
    p.add_argument("--image", type=int, default=16, help="ResNet image side (default 16)")
    p.add_argument("--world", type=int, default=2, help="DDP ranks and monarch's dp size (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="measurements per configuration, the fastest kept (default 1)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess (default 300)")
    p.add_argument("--one", choices=["ddp", "compiled"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.one:
        run_one(args)
        return
    t0 = time.perf_counter()
    print_machine(args)
    rows: list[Any] = [("model", "params", "DDP step", "compiled step", "vs DDP", "ctl/step",
                        "last loss DDP / monarch", "collectives per step", "RSS/rank DDP / monarch",
                        "optim/rank DDP / monarch", "fallbacks", "ops gathered")]
    rows += [row(name, args) for name in args.models]
    print_rows(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
