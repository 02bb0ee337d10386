"""Rules for ops that make a new tensor from a MeshTensor argument: *_like, rand*_like and new_*.

The argument's values are never read, so it stays where it is; the output follows its shard (R when it
is replicated or Partial). Random values are drawn as pieces of one global tensor from a seed shared by
all ranks, so they do not depend on the placement. `empty` variants fill zeros, as monarch.empty does.
(`fill_`, `zero_` and `copy_` are pointwise rules.)
"""
from __future__ import annotations

from typing import Any

import torch

from monarch.graph.rules import Emit, OpCall, R, Strategy, register_rule
from monarch.graph.rules_view import resized
from monarch.tensor.instr import Local
from monarch.tensor.placement import Placement, Shard

aten = torch.ops.aten

LIKE = sorted([aten.empty_like.default, aten.full_like.default, aten.ones_like.default, aten.zeros_like.default],
              key=str)
NEW = sorted([aten.new_empty.default, aten.new_empty_strided.default, aten.new_full.default, aten.new_ones.default,
              aten.new_zeros.default], key=str)
RANDOM_LIKE = {aten.rand_like.default: "rand", aten.randn_like.default: "randn",
               aten.randint_like.default: "randint", aten.randint_like.low_dtype: "randint"}
ZEROED = {aten.empty_like.default: "aten::zeros_like", aten.new_empty.default: "aten::new_zeros"}


def _kept(p: Placement) -> Placement:
    """The output placement when the argument is placed `p` on a mesh dim."""
    return p if isinstance(p, Shard) else R


@register_rule(*LIKE)
def like(call: OpCall, mdim: int) -> list[Strategy]:
    p = call.ins[0].placements[mdim]
    return [Strategy((p,), (_kept(p),), _zeroed if call.op in ZEROED else None)]


def _zeroed(ctx: Emit) -> list[Local]:
    return [Local(ZEROED[ctx.call.op], ctx.args, ctx.kwargs, ctx.out_ids)]


@register_rule(*NEW)
def new(call: OpCall, mdim: int) -> list[Strategy]:
    """new_*(x, size): replicated, or sharded like x where the new size matches x's sharded dim."""
    x, out = call.ins[0], call.outs[0]
    p = call.ins[0].placements[mdim]
    strategies = [Strategy((p,), (R,), _new_emit)]
    if isinstance(p, Shard) and p.dim < out.ndim and out.shape[p.dim] == x.shape[p.dim]:
        strategies.append(Strategy((p,), (p,), _new_emit))
    return strategies


def _new_emit(ctx: Emit) -> list[Local]:
    if ctx.call.op is aten.new_empty_strided.default:  # global strides mean nothing to a piece: zeros
        return [Local("aten::new_zeros", (ctx.args[0], list(ctx.local_out_shape())), ctx.kwargs, ctx.out_ids)]
    return resized(ctx, ZEROED.get(ctx.call.op))


@register_rule(*RANDOM_LIKE)
def random_like(call: OpCall, mdim: int) -> list[Strategy]:
    """Listed before "all replicated" (which would draw different values per rank), so it wins ties."""
    p = call.ins[0].placements[mdim]
    return [Strategy((p,), (_kept(p),), _random_emit)]


def _random_emit(ctx: Emit) -> list[Local]:
    """This rank's piece of the global random tensor; the seed is the same on every rank."""
    out, call = ctx.outs[0], ctx.call
    kwargs: dict[str, Any] = {"dtype": out.dtype}
    if RANDOM_LIKE[call.op] == "randint":
        low, high = (call.args[1], call.args[2]) if call.op == aten.randint_like.low_dtype else (0, call.args[1])
        kwargs.update(low=low, high=high)
    seed = ctx.seed
    return [Local("monarch::random", (RANDOM_LIKE[call.op], out.shape, out.bounds(ctx.coords), seed, kwargs), {},
                  ctx.out_ids)]
