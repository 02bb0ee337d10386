"""Rules for signal and sequence ops: the FFT kernels every `torch.fft` function records, pairwise distances
(cdist, pdist) and the CTC loss.

FFT (`_fft_r2c`, `_fft_c2r`, `_fft_c2c`): a transform mixes every element along its dims, so those are
replicated and any other dim may stay sharded; a rank whose piece is empty (the kernels refuse one) makes
an empty result. Transforms, `_conj` (which hfft takes first) and the complex/real views are linear over
the reals, so `Partial(sum)` passes through.
cdist(x1 (..., P, M), x2 (..., R, M)) -> (..., P, R) is a matmul-like op: batch dims (broadcasting) and
either operand's rows shard; the features shard only where the distance is a sum over them (p = 0, 1),
giving a Partial result. pdist mixes every row with every other: its input is replicated.
CTC runs each sample alone, so the batch dim shards, with the global length lists cut to this rank's
samples; the overloads taking the lengths as tensors read them first (a sync point: log_alpha's width
depends on them) and run as the list overloads, through the data-dependent rewrites of `tensor/data_dependent.py`.
"""
from __future__ import annotations

import torch

from monarch.graph.rules.common import aten, broadcast_shard, partials, summed
from monarch.graph.rules.table import Emit, OpCall, Strategy, op_name, register_rule
from monarch.program.instr import Free, Instr, Local
from monarch.tensor.placement import P, R, Shard
from monarch.tensor.spec import Spec

TRANSFORMS = sorted([aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default], key=str)
SUMMED_P = (0.0, 1.0)  # distances that are a plain sum over the features
PDIST = sorted([aten._pdist_forward.default, aten._pdist_backward.default], key=str)


# -- FFT --------------------------------------------------------------------------------------------
@register_rule(*TRANSFORMS)
def transform(call: OpCall, mdim: int) -> list[Strategy]:
    """Shard any dim that is not transformed (the output keeps the input's dims; only sizes change)."""
    x = call.ins[0]
    mixed = {d % x.ndim for d in call.arg(1, "dim")}
    kept = [Strategy((Shard(d),), (Shard(d),), _empty_safe) for d in range(x.ndim) if d not in mixed]
    return kept + summed(partials(call, mdim, emit=_empty_safe))


def _empty_safe(ctx: Emit) -> list[Local]:
    """The transform, or zeros of this rank's output shape where its piece is empty."""
    if all(ctx.ins[0].local_shape(ctx.coords)):
        return ctx.default()
    return [Local("aten::new_zeros", (ctx.args[0], list(ctx.local_out_shape())), {"dtype": ctx.outs[0].dtype},
                  ctx.out_ids)]


@register_rule(aten._conj.default)
def conj(call: OpCall, mdim: int) -> list[Strategy]:
    """Elementwise: every dim may be sharded."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim)] + summed(partials(call, mdim))


@register_rule(aten.view_as_real.default)
def view_as_real(call: OpCall, mdim: int) -> list[Strategy]:
    """(..., ) complex -> (..., 2) real: the input's dims keep their numbers."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim)] + summed(partials(call, mdim))


@register_rule(aten.view_as_complex.default)
def view_as_complex(call: OpCall, mdim: int) -> list[Strategy]:
    """(..., 2) real -> (..., ) complex: every dim but the pair's."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim - 1)] + summed(partials(call, mdim))


# -- distances --------------------------------------------------------------------------------------
def _batch(out: Spec, *ins: Spec) -> list[tuple[tuple, int]]:
    """(input placements, output dim) for each batch dim of `out` (inputs that broadcast there replicated)."""
    return [(tuple(broadcast_shard(x, out, d) for x in ins), d) for d in range(out.ndim - 2)]


@register_rule(aten._cdist_forward.default, aten._euclidean_dist.default)
def cdist(call: OpCall, mdim: int) -> list[Strategy]:
    """(x1, x2) -> distances: batch dims, x1's rows (the output's rows), x2's rows (its columns); summed features."""
    x1, x2 = call.ins
    out = call.outs[0]
    strategies = [Strategy(ins, (Shard(d),)) for ins, d in _batch(out, x1, x2)]
    strategies += [Strategy((Shard(x1.ndim - 2), R), (Shard(out.ndim - 2),)),
                   Strategy((R, Shard(x2.ndim - 2)), (Shard(out.ndim - 1),))]
    if call.op is aten._cdist_forward.default and float(call.arg(2, "p")) in SUMMED_P:
        strategies.append(Strategy((Shard(x1.ndim - 1), Shard(x2.ndim - 1)), (P,)))
    return strategies


@register_rule(aten._cdist_backward.default)
def cdist_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad, x1, x2, cdist) -> grad of x1 with the broadcast batch shape: batch dims and x1's rows follow
    the output; x2's rows shard grad's columns, each rank summing over its own (Partial); linear in grad."""
    grad, x1, x2, _ = call.ins
    out = call.outs[0]
    rows, cols = grad.ndim - 2, grad.ndim - 1
    strategies = [Strategy((Shard(d), *ins, Shard(d)), (Shard(d),)) for ins, d in _batch(out, x1, x2)]
    return strategies + [Strategy((Shard(rows), Shard(x1.ndim - 2), R, Shard(rows)), (Shard(out.ndim - 2),)),
                         Strategy((Shard(cols), R, Shard(x2.ndim - 2), Shard(cols)), (P,)),
                         Strategy((P, R, R, R), (P,))]


@register_rule(*PDIST)
def pdist(call: OpCall, mdim: int) -> list[Strategy]:
    """Every row meets every other one: nothing shards (only the implicit all-replicated strategy)."""
    return []


# -- CTC --------------------------------------------------------------------------------------------
@register_rule(aten._ctc_loss.default)
def ctc_loss(call: OpCall, mdim: int) -> list[Strategy]:
    """(log_probs (T, N, C), targets (N, S) or concatenated) -> (nll (N,), log_alpha (N, T, W)): the batch
    shards; concatenated targets stay whole and each rank cuts its own run out of them."""
    log_probs, targets = call.ins
    if log_probs.ndim != 3:
        return []
    return [Strategy((Shard(1), Shard(0) if targets.ndim == 2 else R), (Shard(0), Shard(0)), emit_ctc)]


@register_rule(aten._ctc_loss_backward.default)
def ctc_loss_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad, log_probs, targets, nll, log_alpha) -> grad of log_probs, the batch dim sharded throughout."""
    targets = call.ins[2]
    if call.ins[1].ndim != 3:
        return []
    ins = (Shard(0), Shard(1), Shard(0) if targets.ndim == 2 else R, Shard(0), Shard(0))
    return [Strategy(ins, (Shard(1),), emit_ctc_backward)]


def _own_samples(ctx: Emit, lp: int, tg: int) -> tuple[list, list[Local], list[int]]:
    """The op's arguments with the length lists and (concatenated) targets cut to this rank's samples,
    the slicing that needs, and this rank's target lengths."""
    start, n = ctx.ins[lp].bounds(ctx.coords)[1]
    args = list(ctx.args)
    inputs, lengths = ctx.call.arg(tg + 1, "input_lengths"), ctx.call.arg(tg + 2, "target_lengths")
    own = list(lengths[start:start + n])
    args[tg + 1], args[tg + 2] = list(inputs[start:start + n]), own
    if ctx.ins[tg].ndim == 2:
        return args, [], own
    begin, piece = sum(lengths[:start]), ctx.tmp()
    args[tg] = piece
    return args, [Local("aten::slice.Tensor", (ctx.args[tg], 0, begin, begin + sum(own)), {}, (piece.id,))], own


def emit_ctc(ctx: Emit) -> list[Instr]:
    """The loss of this rank's samples, log_alpha padded (-inf) to the width the longest target of the
    whole batch gives it; zeros where the rank holds no sample (the kernel refuses an empty batch). Every
    rank emits as many instructions (the kernel's ranks pad with an empty Free)."""
    args, instrs, own = _own_samples(ctx, 0, 1)
    narrow, op = ctx.tmp(), op_name(ctx.call.op)
    if own:
        missing = ctx.outs[1].shape[2] - (2 * max(own) + 1)
        run: list[Instr] = [Local(op, tuple(args), ctx.kwargs, (ctx.out_ids[0], narrow.id)), Free(())]
    else:
        missing, lp = 0, ctx.args[0]
        run = [Local("aten::new_zeros", (lp, list(ctx.local_out_shape(i))), {}, (o,))
               for i, o in zip((0, 1), (ctx.out_ids[0], narrow.id), strict=True)]
    return instrs + run + [Local("aten::constant_pad_nd", (narrow, [0, missing], float("-inf")), {},
                                 (ctx.out_ids[1],))]


def emit_ctc_backward(ctx: Emit) -> list[Local]:
    args, instrs, _ = _own_samples(ctx, 1, 2)
    return instrs + [Local(op_name(ctx.call.op), tuple(args), ctx.kwargs, ctx.out_ids)]


def _ctc_backward_meta(grad: torch.Tensor, log_probs: torch.Tensor, *args: object) -> torch.Tensor:
    """The gradient has log_probs' shape, laid out contiguously (torch's CPU kernel fills a new tensor)."""
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


_META = torch.library.Library("aten", "IMPL")
_META.impl("_ctc_loss_backward", _ctc_backward_meta, "Meta")
