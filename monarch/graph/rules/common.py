"""Helpers the rule families share: strategy builders (Partial pass-through, broadcast shards, kept
dims) and emitters of per-rank pieces (a size argument resized, a piece of one global random draw).

The registry and its types stay in `table`; each family module imports what it needs from here.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from monarch.graph.rules.table import Emit, Emitter, OpCall, Strategy, op_name
from monarch.program.instr import Buf, Local
from monarch.tensor.placement import P, Placement, R, Shard
from monarch.tensor.spec import Spec

aten = torch.ops.aten


def partials(call: OpCall, mdim: int, carriers: Iterable[int] | None = None,
             emit: Emitter | None = None) -> list[Strategy]:
    """`P -> P` for ops linear in the `carriers` inputs (default all; the others replicated)."""
    carry = set(range(len(call.ins)) if carriers is None else carriers)
    found = sorted({call.ins[i].placements[mdim] for i in carry if call.ins[i].placements[mdim].is_partial()}, key=repr)
    return [Strategy(tuple(p if i in carry else R for i in range(len(call.ins))), (p,) * len(call.outs), emit)
            for p in found]


def summed(strategies: list[Strategy]) -> list[Strategy]:
    """The strategies whose output is Partial(sum): what passes through an op that is linear but does
    not commute with max, min or prod (a transform, a weighted sum, a scatter-add)."""
    return [s for s in strategies if s.outputs[0] == P]


def broadcast_shard(inp: Spec, out: Spec, d: int) -> Placement:
    """How an input that broadcasts to `out` must be placed when the output is sharded on dim d (R
    where the input lacks that dim or broadcasts along it)."""
    k = d - (out.ndim - inp.ndim)
    return Shard(k) if k >= 0 and inp.shape[k] == out.shape[d] else R


def kept(ndim: int, skip: int, drops: bool) -> dict[int, int]:
    """Input dim -> output dim for every dim but `skip`, which disappears from the output if `drops`."""
    return {k: k - (drops and k > skip) for k in range(ndim) if k != skip}


def resized(ctx: Emit, name: str | None = None) -> list[Local]:
    """The op (or kernel `name`) with its size argument (args[1]) replaced by this rank's output shape."""
    args = (ctx.args[0], list(ctx.local_out_shape()), *ctx.args[2:])
    return [Local(name or op_name(ctx.call.op), args, ctx.kwargs, ctx.out_ids)]


def random_piece(ctx: Emit, kind: str, spec: Spec, kwargs: dict[str, Any], out: int) -> Local:
    """Buffer `out` := this rank's piece of the op's global random tensor of `spec`'s shape, on its device."""
    if spec.device != "cpu":
        kwargs = {**kwargs, "device": spec.device}
    return Local("monarch::random", (kind, spec.shape, spec.bounds(ctx.coords), ctx.seed, kwargs), {}, (out,))


def uniform_piece(ctx: Emit, spec: Spec, kind: str = "rand") -> tuple[Local, Buf]:
    """A temporary holding this rank's piece of a global U[0, 1) (or N(0, 1)) draw, in float32 (float64
    for float64 tensors)."""
    u = ctx.tmp()
    dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
    return random_piece(ctx, kind, spec, {"dtype": dtype}, u.id), u
