"""A torchrun job (2 ranks, gloo) with the checkpoint tests' model sharded by DTensor, as plain DCP users run it.

`dtensor_job.py SAVE LOAD`: weights from seed 11, Linear weights Shard(0) and the rest replicated over
the 2 ranks, one AdamW step on the batch of seed 11 (dropout off), then dcp.save of get_state_dict(model,
opt) and step=1 to SAVE. Then it waits for a checkpoint to appear at LOAD (its .metadata), loads it into
a model of another seed with dcp.load and set_state_dict, and rank 0 prints the step and the sum of
every full parameter.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh

from tests.checkpoint.ckpt_runs import batches, build, losses, stepper

WAIT = 100.0  # seconds to wait for the checkpoint to load


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (2,))
    model, _ = build(None, seed)

    def place(name: str, module: torch.nn.Module, mesh: object) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if isinstance(module, torch.nn.Linear) and p.ndim == 2 else Replicate()
            module.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))

    def inputs(module: torch.nn.Module, args: tuple, mesh: object) -> tuple:
        return tuple(distribute_tensor(a, mesh, [Replicate()]) for a in args)
    distribute_module(model, mesh, place, input_fn=inputs, output_fn=lambda module, out, mesh: out.full_tensor())
    model.eval()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def save(path: str) -> None:
    model, opt = sharded(11)
    losses(stepper(model, opt, False), batches(1, seed=11))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=path)


def load(path: str) -> None:
    deadline = time.monotonic() + WAIT
    while not os.path.exists(os.path.join(path, ".metadata")):
        assert time.monotonic() < deadline, f"no checkpoint at {path} after {WAIT} s"
        time.sleep(0.1)
    model, opt = sharded(3)
    losses(stepper(model, opt, False), batches(1, seed=3))  # optimizer state to load into
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    total = sum(p.full_tensor().double().sum().item() for p in model.parameters())
    if dist.get_rank() == 0:
        print(f"step {sd['step']} checksum {total:.6e}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    save(sys.argv[1])
    load(sys.argv[2])
    dist.barrier()  # both ranks are done with their collectives before gloo is torn down
    dist.destroy_process_group()
