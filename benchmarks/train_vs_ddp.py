"""Training throughput of examples/gpt.py: monarch against torchrun + DistributedDataParallel and plain torch.

Every configuration trains the same model (same seed, global batch and AdamW) in a subprocess of its own
(with a timeout) and reports the mean step time over --steps steps after --warmup warm-up steps:
- torch: plain single-process torch on all cores.
- ddp W: `torchrun --nproc-per-node W` + DistributedDataParallel (gloo, CPU); each rank trains on its slice
  of the global batch with cores / W intra-op threads, as monarch's workers get by default.
- compiled W / eager W: monarch on a dp=W mesh (monarch.data_parallel), the step under monarch.compile or
  run op by op; `ctl/step` is the controller's own CPU time per step call (sending the batch, and
  recording or launching the step), the rest overlaps with the workers. "compiled" runs with weight-update
  sharding as MONARCH_SHARD_UPDATE says (default auto), "replicated update" with it off (every rank
  updates every parameter, as DDP does).
`collectives/step` counts the gradient collectives of one step: DDP's buckets, a compiled step's buckets
(all_reduce; or reduce_scatter + all_gather with sharded updates). `RSS/rank` is rank 0's resident memory
after the steps (monarch: the largest of its worker's samples); `optim/rank` the bytes of optimizer state
rank 0 holds.
Ratios are throughputs against DDP at the same world size. A width sweep (Pathways-style) then finds the
smallest step time at which compiled monarch reaches 0.95x DDP. Run with --help for the knobs.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
import gpt  # noqa: E402
from actors import machine  # noqa: E402

TARGET = 0.95  # the throughput ratio to DDP the sweep looks for


@dataclass(frozen=True)
class Run:
    """One configuration to measure."""
    kind: str  # torch | ddp | compiled | replicated | eager
    world: int
    width: int


@dataclass(frozen=True)
class Result:
    step_s: float          # mean wall time per step
    ctl_s: float | None    # controller time per step (monarch only)
    loss: float            # global loss of the last step
    all_reduces: int | None = None  # gradient collectives per step (DDP's buckets; a compiled step's)
    rss_bytes: int | None = None    # rank 0's resident memory
    optim_bytes: int | None = None  # optimizer state rank 0 holds


def rss() -> int:
    """This process's resident memory in bytes."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def optim_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of `opt`'s state tensors this process (rank 0 of a mesh) holds."""
    from monarch.tensor.meshtensor import MeshTensor
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, MeshTensor):
                local = v._spec.local_shape((0,) * len(v.placements))
                total += v.element_size() * int(torch.Size(local).numel())
            elif isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


# -- one configuration, measured in this process --------------------------------------------------------------
def timed(step: Callable[..., Any], batches: Iterator[tuple[Any, ...]], sync: Callable[[Any], float], warmup: int,
          steps: int, barrier: Callable[[], None] = lambda: None) -> Result:
    """Mean time of `steps` calls of `step` after `warmup` synced ones; `sync` waits for a step's loss.
    The controller time is the CPU time of the calling thread inside the `step` calls (not the batch
    sampling, nor the background thread that reads replies)."""
    for _ in range(warmup):
        sync(step(*next(batches)))
    barrier()
    t0 = time.perf_counter()
    busy = 0.0
    for _ in range(steps):
        batch = next(batches)
        t = time.thread_time()
        loss = step(*batch)
        busy += time.thread_time() - t
    final = sync(loss)
    barrier()
    return Result((time.perf_counter() - t0) / steps, busy / steps, final)


def text(args: argparse.Namespace) -> torch.Tensor:
    """The training text the driver snapshot once, so that every configuration sees the same bytes."""
    return torch.load(args.data) if args.data else gpt.load_text()


def config(args: argparse.Namespace, width: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(d_model=width, n_layer=args.layers, n_head=args.heads, context=args.context)


def run_torch(args: argparse.Namespace) -> Result:
    cfg = config(args, args.width)
    model = gpt.build(cfg, args.seed)
    opt = gpt.optimizer(model)
    step = gpt.train_step(model, opt)
    stream = gpt.batches(text(args), args.batch, cfg.context, args.seed)
    r = timed(step, stream, lambda loss: loss.item(), args.warmup, args.steps)
    return Result(r.step_s, None, r.loss, None, rss(), optim_bytes(opt))


def run_ddp(args: argparse.Namespace) -> Result:
    """One rank of a torchrun job: its slice of every global batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = config(args, args.width)
    model = DistributedDataParallel(gpt.build(cfg, args.seed))
    opt = gpt.optimizer(model)
    step = gpt.train_step(model, opt)
    stream = gpt.batches(text(args), args.batch, cfg.context, args.seed)
    per = args.batch // world

    def one(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return step(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])

    def sync(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world
    try:
        r = timed(one, stream, sync, args.warmup, args.steps, dist.barrier)
        logged = model._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]
        return Result(r.step_s, None, r.loss, len(str(sizes).split(",")), rss(), optim_bytes(opt))
    finally:
        dist.destroy_process_group()


def run_monarch(args: argparse.Namespace, eager: bool) -> Result:
    """Compiled or eager monarch; then one more compiled step counts the all_reduces a step runs."""
    import monarch
    from monarch.actor import this_host
    from monarch.runtime.session.session import session_of
    cfg = config(args, args.width)
    stream = gpt.batches(text(args), args.batch, cfg.context, args.seed)
    with this_host().spawn_procs(per_host={"dp": args.world}) as procs:
        model = monarch.data_parallel(gpt.build(cfg, args.seed), procs, dim="dp")
        opt = gpt.optimizer(model)
        step = gpt.compile_step(gpt.train_step(model, opt), eager=eager)

        def sync(loss: torch.Tensor) -> float:
            return monarch.fetch(loss).get(timeout=args.timeout).item()
        r = timed(step, stream, sync, args.warmup, args.steps)
        ((peak,),) = procs.sql("SELECT max(rss_bytes) FROM memory WHERE rank = 0")
        if eager:
            return Result(r.step_s, r.ctl_s, r.loss, None, peak, optim_bytes(opt))
        shipped = session_of(procs).collectives
        before = len(shipped)
        loss = step(*next(stream))
        count = len(shipped) - before
        sync(loss)
        return Result(r.step_s, r.ctl_s, r.loss, count, peak, optim_bytes(opt))


def run_one(args: argparse.Namespace) -> None:
    kind = args.one
    if kind == "replicated":
        os.environ["MONARCH_SHARD_UPDATE"] = "off"
    result = (run_torch(args) if kind == "torch" else run_ddp(args) if kind == "ddp"
              else run_monarch(args, eager=kind == "eager"))
    if kind != "ddp" or int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(asdict(result)), flush=True)


# -- the driver: each configuration in a subprocess with a timeout ---------------------------------------------
def command(run: Run, args: argparse.Namespace) -> list[str]:
    common = [str(Path(__file__).resolve()), "--one", run.kind, "--world", str(run.world), "--width", str(run.width),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
              "--layers", str(args.layers), "--heads", str(args.heads), "--context", str(args.context),
              "--seed", str(args.seed), "--timeout", str(args.timeout), "--data", args.data]
    if run.kind == "ddp":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        return [torchrun, "--standalone", f"--nproc-per-node={run.world}", *common]
    return [sys.executable, *common]


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, read from /proc (before anything is killed)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) if d.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(d.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def measure(run: Run, args: argparse.Namespace) -> Result | str:
    """The run's Result, or why there is none."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // run.world))}
    got = result_of(command(run, args), env, args.timeout, f"{NAMES[run.kind]}, world {run.world}, d_model {run.width}")
    return got if isinstance(got, str) else Result(**got)


def result_of(cmd: list[str], env: dict[str, str], timeout: float, label: str) -> dict[str, Any] | str:
    """Run one configuration's subprocess (its whole process tree killed after `timeout` s): the fields of
    the last `RESULT {json}` line it printed, or why there are none."""
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in process_tree(proc.pid):  # torchrun's ranks and mpiexec's workers run in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()
            return f"timed out after {timeout} s"
        finally:
            print(f"  measured {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        return f"exit {proc.returncode}: {tail[:100]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


NAMES = {"torch": "plain torch, 1 process", "ddp": "torchrun + DDP (gloo)", "compiled": "monarch compiled",
         "replicated": "  replicated update", "eager": "monarch eager"}


def main_table(args: argparse.Namespace) -> None:
    runs = [Run("torch", 1, args.width)]
    for world in args.worlds:
        runs += [Run(kind, world, args.width) for kind in ("ddp", "compiled", "replicated", "eager")]
    results = {}
    rows = [("configuration", "world", "step time", "steps/s", "ctl/step", "last loss", "collectives/step",
             "RSS/rank", "optim/rank", "vs DDP")]
    for run in runs:
        results[run] = r = measure(run, args)
        if isinstance(r, str):
            rows.append((NAMES[run.kind], str(run.world), r, *[""] * 7))
            continue
        ddp = results.get(Run("ddp", run.world if run.kind != "torch" else min(args.worlds), run.width))
        vs = f"{ddp.step_s / r.step_s:.2f}x" if isinstance(ddp, Result) and run.kind != "ddp" else "-"
        ctl = f"{r.ctl_s * 1e6:,.0f} µs" if r.ctl_s is not None else "-"
        rows.append((NAMES[run.kind], str(run.world), f"{r.step_s * 1e3:,.1f} ms", f"{1 / r.step_s:.2f}", ctl,
                     f"{r.loss:.4f}", "-" if r.all_reduces is None else str(r.all_reduces), mib(r.rss_bytes),
                     mib(r.optim_bytes), vs))
    print_rows(rows)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.1f} MiB"


def sweep(args: argparse.Namespace) -> None:
    """Compiled monarch against DDP at world size args.sweep_world over model widths."""
    world = args.sweep_world
    print(f"\nwidth sweep: {args.layers} layers, {args.heads} heads, global batch {args.batch}, world {world}")
    rows = [("d_model", "params", "DDP step", "compiled step", "ctl/step", "compiled / DDP")]
    reached = []
    for width in args.widths:
        ddp, mon = measure(Run("ddp", world, width), args), measure(Run("compiled", world, width), args)
        params = f"{gpt.n_params(gpt.GPT(config(args, width))) / 1e6:.2f}M"
        if isinstance(ddp, str) or isinstance(mon, str):
            rows.append((str(width), params, str(ddp if isinstance(ddp, str) else ""),
                         str(mon if isinstance(mon, str) else ""), "", ""))
            continue
        ratio = ddp.step_s / mon.step_s
        if ratio >= TARGET:
            reached.append(ddp.step_s)
        rows.append((str(width), params, f"{ddp.step_s * 1e3:,.1f} ms", f"{mon.step_s * 1e3:,.1f} ms",
                     f"{(mon.ctl_s or 0) * 1e6:,.0f} µs", f"{ratio:.2f}x"))
    print_rows(rows)
    if reached:
        print(f"smallest DDP step time at which monarch compiled reaches {TARGET}x DDP: {min(reached) * 1e3:,.1f} ms")
    else:
        print(f"monarch compiled stays below {TARGET}x DDP at every width measured")


def print_rows(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def print_machine(args: argparse.Namespace) -> None:
    cfg = config(args, args.width)
    print(f"monarch train_vs_ddp, {datetime.date.today().isoformat()}, {'quick' if args.quick else 'full'} run")
    print(machine())
    print(f"model: {gpt.n_params(gpt.GPT(cfg)) / 1e6:.2f}M parameters ({cfg}); AdamW; global batch {args.batch}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per configuration\n", flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few steps, two sweep widths: a smoke test")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 20, quick 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first, incl. compile's traces (default 4, quick 3)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    p.add_argument("--width", type=int, default=256, help="d_model of the main table (default 256)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes of the main table")
    p.add_argument("--widths", type=int, nargs="+", help="sweep widths (default 64 128 256 512, quick 64 256)")
    p.add_argument("--sweep-world", type=int, default=2)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess (default 300)")
    p.add_argument("--one", choices=sorted(NAMES), help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (4 if args.quick else 20)
    args.warmup = args.warmup or (3 if args.quick else 4)
    args.widths = args.widths or ([64, 256] if args.quick else [64, 128, 256, 512])
    return args


def main() -> None:
    args = parse()
    if args.one:
        run_one(args)
        return
    t0 = time.perf_counter()
    print_machine(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.data = str(Path(tmp) / "text.pt")
        torch.save(gpt.load_text(), args.data)
        main_table(args)
        if not args.no_sweep:
            sweep(args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
