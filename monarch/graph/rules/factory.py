"""Rules for ops that make new values from a MeshTensor argument: *_like, rand*_like, new_*, the random
fills (bernoulli_, uniform_, normal_; the dropout mask is a bernoulli_) and bernoulli.

The argument's values are never read (but bernoulli(x)'s probabilities), so it stays where it is; the
output follows its shard (R when it is replicated or Partial). Random values are drawn as pieces of one
global tensor from a seed shared by all ranks, so they do not depend on the placement. `empty` variants
fill zeros, as monarch.empty does. (`fill_`, `zero_` and `copy_` are pointwise rules.)
"""
from __future__ import annotations

from typing import Any

from monarch.graph.rules.common import aten, random_piece, resized, uniform_piece
from monarch.graph.rules.table import Emit, OpCall, Strategy, register_rule
from monarch.program.instr import Local
from monarch.tensor.placement import Placement, R, Shard

LIKE = sorted([aten.empty_like.default, aten.full_like.default, aten.ones_like.default, aten.zeros_like.default],
              key=str)
NEW = sorted([aten.new_empty.default, aten.new_empty_strided.default, aten.new_full.default, aten.new_ones.default,
              aten.new_zeros.default], key=str)
RANDOM_LIKE = {aten.rand_like.default: "rand", aten.randn_like.default: "randn",
               aten.randint_like.default: "randint", aten.randint_like.low_dtype: "randint"}
ZEROED = {aten.empty_like.default: "aten::zeros_like", aten.new_empty.default: "aten::new_zeros"}
FILLS = sorted([aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default], key=str)


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
    return [random_piece(ctx, RANDOM_LIKE[call.op], out, kwargs, ctx.out_ids[0])]


@register_rule(*FILLS)
def fill(call: OpCall, mdim: int) -> list[Strategy]:
    """In place, the target's values unread: its piece of one global draw (a Partial target becomes R)."""
    p = call.ins[0].placements[mdim]
    return [Strategy((p,), (_kept(p),), _fill_emit)]


def _fill_emit(ctx: Emit) -> list[Local]:
    call = ctx.call
    if call.op is aten.bernoulli_.float:
        kind, steps = "rand", [("aten::lt.Scalar", call.arg(1, "p", 0.5))]
    elif call.op is aten.uniform_.default:
        low, high = call.arg(1, "from", 0.0), call.arg(2, "to", 1.0)
        kind, steps = "rand", [("aten::mul.Scalar", high - low), ("aten::add.Scalar", low)]
    else:
        mean, std = call.arg(1, "mean", 0.0), call.arg(2, "std", 1.0)
        kind, steps = "randn", [("aten::mul.Scalar", std), ("aten::add.Scalar", mean)]
    draw, x = uniform_piece(ctx, ctx.outs[0], kind)
    instrs = [draw]
    for op, c in steps:
        y = ctx.tmp()
        instrs.append(Local(op, (x, c), {}, (y.id,)))
        x = y
    return instrs + [Local("aten::copy_", (ctx.args[0], x), {}, ctx.out_ids)]


@register_rule(aten.bernoulli.p, aten.bernoulli.default)
def bernoulli(call: OpCall, mdim: int) -> list[Strategy]:
    """bernoulli(x, p) as a fill; bernoulli(x) reads x's probabilities, so a Partial x is reduced first."""
    p = call.ins[0].placements[mdim]
    if call.op is aten.bernoulli.default and p.is_partial():
        p = R
    return [Strategy((p,), (_kept(p),), _bernoulli_emit)]


def _bernoulli_emit(ctx: Emit) -> list[Local]:
    """1 where this rank's piece of a global U[0, 1) draw is below the probability."""
    out, hit = ctx.outs[0], ctx.tmp()
    draw, u = uniform_piece(ctx, out)
    if ctx.call.op is aten.bernoulli.default:
        below = Local("aten::lt.Tensor", (u, ctx.args[0]), {}, (hit.id,))
    else:
        below = Local("aten::lt.Scalar", (u, ctx.call.arg(1, "p")), {}, (hit.id,))
    return [draw, below, Local("aten::_to_copy", (hit,), {"dtype": out.dtype}, ctx.out_ids)]
