"""Rules for ops that make new values from a MeshTensor argument: *_like, rand*_like, new_*, the random
fills (uniform_, normal_, bernoulli_, exponential_, ..., random_: what nn.init draws with; the dropout
mask is a bernoulli_) and bernoulli.

The argument's values are never read (but bernoulli(x)'s probabilities), so it stays where it is; the
output follows its shard (R when it is replicated or Partial). Random values are drawn as pieces of one
global tensor from a seed shared by all ranks, so they do not depend on the placement. `empty` variants
fill zeros, as monarch.empty does. (`fill_`, `zero_` and `copy_` are pointwise rules.)
"""
from __future__ import annotations

import math
from typing import Any

import torch

from monarch.graph.rules.common import aten, broadcast_shard, random_piece, resized, uniform_piece
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
RANDOM_FROM = getattr(aten.random_, "from")
RANDOM_INTS = (aten.random_.default, aten.random_.to, RANDOM_FROM)
MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}  # digits, the implicit one too
FILLS = sorted([aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default, aten.normal_.default,
                aten.log_normal_.default, aten.exponential_.default, aten.geometric_.default, aten.cauchy_.default,
                *RANDOM_INTS], key=str)


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
    """In place, the target's values unread: its piece of one global draw (a Partial target becomes R);
    bernoulli_'s probability tensor is placed as the target's piece needs it (broadcast like an operand)."""
    p = call.ins[0].placements[mdim]
    if len(call.ins) == 1:
        return [Strategy((p,), (_kept(p),), _fill_emit)]
    prob = broadcast_shard(call.ins[1], call.ins[0], p.dim) if isinstance(p, Shard) else R
    return [Strategy((p, prob), (_kept(p),), _fill_emit)]


Step = tuple[Any, ...]  # (kernel, *arguments after the running value)


def _uniform_steps(call: OpCall) -> tuple[str, list[Step]]:
    """How each fill turns its piece of a global U[0, 1) ("rand") or N(0, 1) ("randn") draw into its law
    (inverse transforms); random_ draws its integers directly."""
    op, arg = call.op, call.arg
    if op is aten.bernoulli_.float:
        return "rand", [("aten::lt.Scalar", arg(1, "p", 0.5))]
    if op is aten.uniform_.default:
        low, high = arg(1, "from", 0.0), arg(2, "to", 1.0)
        return "rand", [("aten::mul.Scalar", high - low), ("aten::add.Scalar", low)]
    if op is aten.normal_.default:
        return "randn", [("aten::mul.Scalar", arg(2, "std", 1.0)), ("aten::add.Scalar", arg(1, "mean", 0.0))]
    if op is aten.log_normal_.default:
        return "randn", [("aten::mul.Scalar", arg(2, "std", 2.0)), ("aten::add.Scalar", arg(1, "mean", 1.0)),
                         ("aten::exp",)]
    if op is aten.exponential_.default:  # -log(1 - u) / lambda
        return "rand", [("aten::neg",), ("aten::log1p",), ("aten::div.Scalar", -arg(1, "lambd", 1.0))]
    if op is aten.geometric_.default:  # ceil(log(1 - u) / log(1 - p)), at least 1
        return "rand", [("aten::neg",), ("aten::log1p",), ("aten::div.Scalar", math.log1p(-arg(1, "p"))),
                        ("aten::ceil",), ("aten::clamp_min", 1)]
    assert op is aten.cauchy_.default, f"no transform for {op}"  # median + sigma * tan(pi * (u - 1/2))
    return "rand", [("aten::sub.Scalar", 0.5), ("aten::mul.Scalar", math.pi), ("aten::tan",),
                    ("aten::mul.Scalar", arg(2, "sigma", 1.0)), ("aten::add.Scalar", arg(1, "median", 0.0))]


def _fill_emit(ctx: Emit) -> list[Local]:
    call, target = ctx.call, ctx.outs[0]
    if call.op in RANDOM_INTS:
        x = ctx.tmp()
        low, high = _int_range(call, target.dtype)
        instrs = [random_piece(ctx, "randint", target, {"low": low, "high": high, "dtype": torch.int64}, x.id)]
    elif call.op is aten.bernoulli_.Tensor:
        draw, u = uniform_piece(ctx, target)
        x = ctx.tmp()
        instrs = [draw, Local("aten::lt.Tensor", (u, ctx.args[1]), {}, (x.id,))]
    else:
        kind, steps = _uniform_steps(call)
        draw, x = uniform_piece(ctx, target, kind)
        instrs = [draw]
        for op, *rest in steps:
            y = ctx.tmp()
            instrs.append(Local(op, (x, *rest), {}, (y.id,)))
            x = y
    return instrs + [Local("aten::copy_", (ctx.args[0], x), {}, ctx.out_ids)]


def _int_range(call: OpCall, dtype: torch.dtype) -> tuple[int, int]:
    """random_'s [low, high): [0, to), [from, to), or from 0 (or `from`) to the dtype's largest value
    (for floats the largest integer the mantissa holds exactly), as plain torch draws."""
    if call.op is aten.random_.to:
        return 0, call.arg(1, "to")
    low = call.arg(1, "from", 0) if call.op is RANDOM_FROM else 0
    to = call.arg(2, "to") if call.op is RANDOM_FROM else None
    if to is not None:
        return low, to
    if dtype == torch.bool:
        return low, 2
    if dtype.is_floating_point:
        return low, (1 << MANTISSA[dtype]) + 1
    return low, min(torch.iinfo(dtype).max + 1, torch.iinfo(torch.int64).max)


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
