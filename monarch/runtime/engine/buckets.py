"""How a bucket of collectives (a `Start`) travels as one collective over one flat buffer.

all_reduce: the buffers one after the other. reduce_scatter: one segment per group member, holding that
member's slice of every buffer (along the buffer's `dims[k]`), each segment padded to the longest, so that
an even reduce_scatter of the whole gives each member its segment. all_gather: this member's buffers one
after the other, padded to the longest member's total; the gathered segments are cut apart and each buffer's
pieces concatenated along its dim. Every member computes the same layout from the Start alone.
"""
from __future__ import annotations

import functools
from math import prod

import torch

from monarch.program.instr import Comm, Start


@functools.lru_cache(maxsize=1024)
def comm(ins: Start) -> Comm:
    """The one collective that carries bucket `ins` (its src and out ids are not used); computed once per
    bucket of an installed program, which runs at every step."""
    if ins.kind == "all_reduce":
        n = sum(prod(s) for s in ins.shapes)
        return Comm("all_reduce", -1, -1, ins.mdim, ((n,),), ins.dtype, op=ins.op)
    width = len(ins.groups[0])
    seg = max(sum(prod(s) for s in _pieces(ins, r)) for r in range(width))
    n = seg * width if ins.kind == "reduce_scatter" else seg
    return Comm(ins.kind, -1, -1, ins.mdim, ((n,),) * width, ins.dtype, op=ins.op)


def _pieces(ins: Start, r: int) -> list[tuple[int, ...]]:
    """The shapes of member `r`'s piece of each buffer: its slice (reduce_scatter) or its input (all_gather)."""
    return [g[r] for g in ins.groups]


def pack(ins: Start, xs: list[torch.Tensor]) -> torch.Tensor:
    """The flat buffer a member contributes, from its buffers `xs`."""
    if ins.kind == "all_reduce":
        return torch.cat([x.reshape(-1) for x in xs])
    c = comm(ins)
    flat = torch.zeros(c.shapes[0], dtype=ins.dtype, device=xs[0].device if xs else "cpu")
    if ins.kind == "all_gather":
        _fill(flat, [x.reshape(-1) for x in xs])
        return flat
    width = len(ins.groups[0])
    seg = c.shapes[0][0] // width
    at = [0] * len(xs)  # where member r's slice of each buffer starts along its dim
    for r in range(width):
        parts = []
        for k, (x, d, g) in enumerate(zip(xs, ins.dims, ins.groups, strict=True)):
            parts.append(x.narrow(d, at[k], g[r][d]).reshape(-1))
            at[k] += g[r][d]
        _fill(flat[r * seg:(r + 1) * seg], parts)
    return flat


def _fill(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    at = 0
    for p in parts:
        dst[at:at + p.numel()].copy_(p)
        at += p.numel()


def unpack(ins: Start, flat: torch.Tensor, me: int) -> list[torch.Tensor]:
    """Member `me`'s results, one per buffer, from the collective's output `flat`."""
    if ins.kind == "all_reduce":
        return _cut(flat, list(ins.shapes))
    if ins.kind == "reduce_scatter":
        return _cut(flat, _pieces(ins, me))
    width = len(ins.groups[0])
    seg = flat.numel() // width
    per_member = [_cut(flat[r * seg:(r + 1) * seg], _pieces(ins, r)) for r in range(width)]
    return [torch.cat([per_member[r][k] for r in range(width)], d) for k, d in enumerate(ins.dims)]


def _cut(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        n = prod(s)
        out.append(flat[at:at + n].view(s))
        at += n
    return out
