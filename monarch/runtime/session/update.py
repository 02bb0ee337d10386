"""What a recorded step does around each optimizer step: gradients reduced as DDP reduces them, and weight
updates sharded over data-parallel mesh dims (ZeRO-1/2; Xu et al., "Automatic Cross-Replica Sharding of
Weight Update", 2020).

While a step is recorded, torch's global optimizer hooks run these. Before the step, a parameter replicated over a
mesh dim its gradient is Partial on (a data-parallel dim) gets its gradient reduce-scattered to a slice per rank
along one of its tensor dims, and the optimizer is handed the parameter's slice in its place (a local narrowing:
no communication), with the parameter's state: the update, and the state it creates (momentum, Adam's moments),
then live sharded, 1/W of it per rank. After the step the updated slices are all-gathered into the parameter
and the optimizer gets the parameter back. A MeshTensor's value is global, so `p.grad`, `optimizer.state_dict()`,
`full_state_dict` and checkpoints mean what they meant: only the placements say the pieces are spread.
Other gradients are reduced to their parameters' placements before the step, so schedule.overlap can bucket
their all_reduces; with MONARCH_BUCKET_MB=0 they are reduced where the optimizer reads them.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from monarch import config
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Partial, Placements, Replicate, Shard


@dataclass
class _Lent:
    """A parameter whose slice `opt` steps in its place: `group["params"][at]` is `piece` meanwhile."""
    opt: torch.optim.Optimizer
    group: dict
    at: int
    param: MeshTensor
    piece: MeshTensor


@contextlib.contextmanager
def at_optimizer_steps() -> Iterator[None]:
    """While a step is recorded: gradients reduced (and updates sharded, as MONARCH_SHARD_UPDATE says) around
    every optimizer step the step runs."""
    mode, bucketed = config.shard_update(), config.bucket_bytes() > 0
    if mode == "off" and not bucketed:
        yield
        return
    lent: dict[int, list[_Lent]] = {}
    handles = [register_optimizer_step_pre_hook(functools.partial(_before, mode, bucketed, lent)),
               register_optimizer_step_post_hook(functools.partial(_after, lent))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for pieces in lent.values():  # a step that raised: every optimizer gets its parameters back
            _give_back(pieces)


def _before(mode: str, bucketed: bool, lent: dict[int, list[_Lent]], opt: torch.optim.Optimizer, *_: object) -> None:
    pieces = lent.setdefault(id(opt), [])
    for group in opt.param_groups:
        for at, p in enumerate(group["params"]):
            g = p.grad
            if not (isinstance(p, MeshTensor) and isinstance(g, MeshTensor) and g._backend is p._backend):
                continue
            target = sharded(p, g, mode)
            if target is not None:
                pieces.append(_lend(opt, group, at, p, g, target))
            elif bucketed and any(isinstance(x, Partial) for x in g.placements):
                p.grad = g.redistribute(p.placements)


def _lend(opt: torch.optim.Optimizer, group: dict, at: int, p: MeshTensor, g: MeshTensor,
          target: Placements) -> _Lent:
    """Hand the optimizer `p`'s slice (placed as `target`), with the reduce-scattered gradient and p's state."""
    if g.placements != target:
        g = g.redistribute(target)
    p.grad = g
    with torch.no_grad():
        piece = p.redistribute(target)
    piece.grad = g
    group["params"][at] = piece
    if p in opt.state:
        opt.state[piece] = opt.state.pop(p)
    return _Lent(opt, group, at, p, piece)


def _after(lent: dict[int, list[_Lent]], opt: torch.optim.Optimizer, *_: object) -> None:
    pieces = lent.pop(id(opt), [])
    with torch.no_grad():
        for x in pieces:
            x.param.copy_(x.piece.redistribute(x.param.placements))
    _give_back(pieces)


def _give_back(pieces: list[_Lent]) -> None:
    for x in pieces:
        x.group["params"][x.at] = x.param
        if x.piece in x.opt.state:
            x.opt.state[x.param] = x.opt.state.pop(x.piece)


def sharded(p: MeshTensor, g: MeshTensor, mode: str) -> Placements | None:
    """The placements `p`'s update runs in: `p`'s, with the largest mesh dim over which `p` is replicated and
    `g` is Partial (a data-parallel dim) sharding a tensor dim whose slices each rank can take without
    communication; None when the update is not sharded (MONARCH_SHARD_UPDATE, the size threshold, or no
    such dims)."""
    if mode == "off" or (mode == "auto" and p.numel() * p.element_size() < config.shard_update_bytes()):
        return None
    sizes = p._spec.mesh.sizes
    dp = [i for i, (a, b) in enumerate(zip(p.placements, g.placements, strict=True))
          if isinstance(a, Replicate) and isinstance(b, (Partial, Shard)) and sizes[i] > 1]
    if not dp:
        return None
    i = max(dp, key=lambda j: sizes[j])
    if isinstance(g.placements[i], Shard):  # a gradient sharded by an earlier step (accumulated into)
        return tuple(g.placements[i] if j == i else x for j, x in enumerate(p.placements))
    dim = _splittable(p, i)
    return None if dim is None else tuple(Shard(dim) if j == i else x for j, x in enumerate(p.placements))


def _splittable(p: MeshTensor, i: int) -> int | None:
    """The first tensor dim of `p` that mesh dim `i` can shard by narrowing each rank's piece: no later mesh
    dim shards it (so its slices nest inside those of the earlier ones), and each rank's piece of it has at
    least one row per member of `i`."""
    sizes = p._spec.mesh.sizes
    for d, n in enumerate(p.shape):
        if any(isinstance(x, Shard) and x.dim == d for x in p.placements[i + 1:]):
            continue
        for j, x in enumerate(p.placements[:i]):
            if isinstance(x, Shard) and x.dim == d:
                n = -(-n // sizes[j])
        if n >= sizes[i]:
            return d
    return None
