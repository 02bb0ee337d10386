"""Meta-device initialisation: a GPT (examples/gpt.py) of a few GB is built under `torch.device("meta")`, so
that no process ever holds it whole, tensor-parallelised with DTensor's names over a 4-rank mesh, made on
the workers with `to_empty`, initialised there with `reset_parameters`, and trained one step. The controller's
memory stays that of an empty process: it prints its RSS next to the model's size.

    python examples/meta_init.py            # ~600M parameters (2.3 GiB in float32), one SGD step
    python examples/meta_init.py --tiny     # a small GPT: the same path in seconds (tests/dtensor runs it)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402 - the example's model, next to this file

import monarch  # noqa: E402
from monarch.dtensor import init_device_mesh  # noqa: E402
from monarch.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

FULL = gpt.GPTConfig(d_model=2048, n_layer=12, n_head=16, context=64)
TINY = gpt.GPTConfig(d_model=64, n_layer=2, n_head=4, context=16)
PLAN = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.out": RowwiseParallel(),
        "blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}


def rss() -> tuple[float, float]:
    """This process's resident set and its peak since `forget_peak`, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def forget_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def init_weights(model: gpt.GPT) -> None:
    """What the constructor did to the meta tensors, done again on the workers: every module's
    reset_parameters, and the buffers (positions, causal masks)."""
    cfg = model.cfg
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        model.positions.copy_(torch.arange(cfg.context))
        for block in model.blocks:
            block.attn.mask.copy_(torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril())


def main(tiny: bool, tp: int) -> None:
    cfg = TINY if tiny else FULL
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    forget_peak()
    start, _ = rss()
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {gpt.n_params(model) / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB, on a tp={tp} mesh")
    parallelize_module(model, mesh, PLAN)  # every other parameter and buffer: replicated
    assert all(p.is_meta for p in model.parameters())
    t0 = time.perf_counter()
    model.to_empty(device=None)  # each rank's pieces, made on its worker
    monarch.manual_seed(0)
    init_weights(model)
    monarch.synchronize(mesh)
    print(f"materialised and initialised on the workers in {time.perf_counter() - t0:.1f} s")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(gpt.batches(gpt.load_text(), 2, cfg.context, seed=0))
    t0 = time.perf_counter()
    loss = gpt.lm_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"one SGD step: loss {loss.item():.4f} in {time.perf_counter() - t0:.1f} s")
    now, peak = rss()
    print(f"controller RSS: {start:.0f} MiB at start, {now:.0f} MiB now, peak {peak:.0f} MiB "
          f"(+{peak - start:.0f} MiB) for a {size / 2**20:.0f} MiB model")
    mesh.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small GPT (the test's mode)")
    parser.add_argument("--tp", type=int, default=4, help="ranks of the tensor-parallel mesh")
    args = parser.parse_args()
    main(args.tiny, args.tp)
