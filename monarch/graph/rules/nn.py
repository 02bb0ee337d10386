"""Rules for neural-network ops: softmax and log_softmax, layer norm, embedding, nll_loss and nll_loss2d
(and their backward ops), native_dropout, `monarch::linear` (F.linear on 3+ dims) and its weight
gradient; cross_entropy reaches dispatch as _log_softmax + nll_loss(2d)_forward, F.dropout on CPU
tensors as a bernoulli_ mask (rules/factory.py) times the input. Attention: the CPU flash kernels
`F.scaled_dot_product_attention` dispatches to (forward and backward) and `_safe_softmax`.

Rows stay sharded along dims the op does not mix (batch dims); parameter gradients summed over a
sharded batch become Partial(sum). A vocab-sharded embedding looks up its own rows and masks the rest.

Attention: queries (B, Hq, L, E) attend to keys and values (B, Hk, S, E); batch and heads never mix, so
either stays sharded (grouped-query heads when each piece of query heads reads its own piece of kv heads).
Without a causal mask, query rows are independent too: they shard with keys and values replicated, and
the key and value gradients, sums over the rows, come out Partial. The mask broadcasts to (B, Hq, L, S).
The forward is linear in the values and the backward in grad_out, so a Partial sum there passes through.
"""
from __future__ import annotations

import torch

from monarch.graph.rules.common import aten, broadcast_shard, uniform_piece
from monarch.graph.rules.matmul import einsum_strategies  # imports monarch.tensor.ops: torch.ops.monarch
from monarch.graph.rules.table import Emit, OpCall, Strategy, op_name, register_rule
from monarch.graph.rules.view import aligned
from monarch.program.instr import Buf, Free, Instr, Local
from monarch.tensor.placement import P, Placement, R, Shard
from monarch.tensor.spec import Spec

NONE, MEAN, SUM = 0, 1, 2  # nll_loss reductions


def _rest(call: OpCall, first: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """`first` for the leading tensor inputs, R for the others (optional weights and biases)."""
    return first + (R,) * (len(call.ins) - len(first))


# -- softmax ----------------------------------------------------------------------------------------
@register_rule(aten._softmax.default, aten._log_softmax.default)
def softmax(call: OpCall, mdim: int) -> list[Strategy]:
    x = call.ins[0]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """Any dim but the softmax dim; linear in grad_output, so its Partial passes through."""
    y = call.ins[1]
    dim = call.arg(2, "dim") % max(y.ndim, 1)
    strategies = [Strategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(y.ndim) if d != dim]
    return strategies + [Strategy((P, R), (P,))]


# -- layer norm -------------------------------------------------------------------------------------
def _batch_dims(call: OpCall, x: int, shape_arg: int) -> range:
    """Leading dims of input `x` that the normalization does not cover."""
    return range(call.ins[x].ndim - len(call.arg(shape_arg, "normalized_shape")))


@register_rule(aten.native_layer_norm.default)
def layer_norm(call: OpCall, mdim: int) -> list[Strategy]:
    return [Strategy(_rest(call, (Shard(d),)), (Shard(d),) * 3) for d in _batch_dims(call, 0, 1)]


@register_rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """grad_input follows the batch shard; grad_weight and grad_bias sum over the batch: Partial."""
    mask = call.arg(7, "output_mask")
    strategies = []
    for d in _batch_dims(call, 1, 2):
        outs = tuple(p for p, on in zip((Shard(d), P, P), mask, strict=True) if on)
        strategies.append(Strategy(_rest(call, (Shard(d),) * 4), outs))
    return strategies + [Strategy(_rest(call, (P,)), (P,) * len(call.outs))]


# -- embedding --------------------------------------------------------------------------------------
@register_rule(aten.embedding.default)
def embedding(call: OpCall, mdim: int) -> list[Strategy]:
    """Ids sharded: output rows too. Weight sharded on the feature dim: the output's last dim. Weight
    sharded on the vocab: each rank looks up the ids it holds, zeros elsewhere: Partial(sum)."""
    ids, out = call.ins[1], call.outs[0]
    strategies = [Strategy((R, Shard(k)), (Shard(k),)) for k in range(ids.ndim)]
    return strategies + [Strategy((Shard(1), R), (Shard(out.ndim - 1),)), Strategy((P, R), (P,)),
                         Strategy((Shard(0), R), (P,), emit_vocab_embedding)]


def emit_vocab_embedding(ctx: Emit) -> list[Local]:
    """Look up ids in this rank's vocab rows [start, start+n); ids outside get zero rows. A rank with no
    rows looks up a one-row zero table instead (every rank makes it when any rank needs it)."""
    w = ctx.ins[0]
    start, n = w.bounds(ctx.coords)[0]
    shifted, clamped, outside, wide, table, found = (ctx.tmp() for _ in range(6))
    instrs = [Local("aten::sub.Scalar", (ctx.args[1], start), {}, (shifted.id,)),
              Local("aten::clamp", (shifted, 0, max(n - 1, 0)), {}, (clamped.id,)),
              Local("aten::ne.Tensor", (shifted, clamped), {}, (outside.id,)),
              Local("aten::unsqueeze", (outside, -1), {}, (wide.id,))]
    weight = ctx.args[0]
    if any(w.local_shape(c)[0] == 0 for c in w.mesh.coords()):
        instrs.append(Local("aten::new_zeros", (weight, [1, w.local_shape(ctx.coords)[1]]), {}, (table.id,)))
        weight = weight if n else table
    return instrs + [Local("aten::embedding", (weight, clamped), {}, (found.id,)),
                     Local("aten::masked_fill.Scalar", (found, wide, 0), {}, ctx.out_ids)]


@register_rule(aten.embedding_dense_backward.default)
def embedding_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """Batch-sharded ids and grads give a Partial weight grad (unless scaled by global id counts)."""
    grad, ids = call.ins
    strategies = [Strategy((Shard(grad.ndim - 1), R), (Shard(1),)), Strategy((P, R), (P,))]
    if not call.arg(4, "scale_grad_by_freq"):
        strategies += [Strategy((Shard(k), Shard(k)), (P,)) for k in range(ids.ndim)]
    return strategies


# -- nll_loss ---------------------------------------------------------------------------------------
def batch_pairs(x: Spec) -> list[tuple[int, int]]:
    """(input dim, target dim) of each batch dim: N of (N, C), and N, H, W of nll_loss2d's (N, C, H, W)."""
    return [] if x.ndim < 2 else [(0, 0), *((d, d - 1) for d in range(2, x.ndim))]


@register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss(call: OpCall, mdim: int) -> list[Strategy]:
    """Batch-sharded: reduction none keeps the shard, sum gives Partial; mean needs the global
    total_weight, so the target is replicated and each rank divides its own sum by it. The loss is
    linear in the input, so a Partial input gives a Partial loss."""
    reduction = call.arg(3, "reduction")
    strategies = [Strategy(_rest(call, (P,)), (P, R))]
    for d, t in batch_pairs(call.ins[0]):
        strategies.append({NONE: Strategy(_rest(call, (Shard(d), Shard(t))), (Shard(t), R)),
                           SUM: Strategy(_rest(call, (Shard(d), Shard(t))), (P, P)),
                           MEAN: Strategy(_rest(call, (Shard(d), R)), (P, R), emit_nll_mean)}[reduction])
    return strategies


def emit_nll_mean(ctx: Emit) -> list[Local]:
    """This rank's summed loss over its rows, divided by the total weight of the whole target."""
    x, weight, ignore = ctx.ins[0], ctx.args[2], ctx.call.arg(4, "ignore_index")
    target = mine = ctx.args[1]
    instrs = []
    for d, t in batch_pairs(x):
        start, n = x.bounds(ctx.coords)[d]
        piece = ctx.tmp()
        instrs.append(Local("aten::slice.Tensor", (mine, t, start, start + n), {}, (piece.id,)))
        mine = piece
    summed, own_weight, total = ctx.tmp(), ctx.tmp(), Buf(ctx.out_ids[1])
    return instrs + [
        Local(op_name(ctx.call.op), (ctx.args[0], mine, weight, SUM, ignore), {}, (summed.id, own_weight.id)),
        *_total_weight(ctx, target, weight, ignore, total),
        Local("aten::div.Tensor", (summed, total), {}, (ctx.out_ids[0],))]


def _total_weight(ctx: Emit, target: Buf, weight: Buf | None, ignore: int, out: Buf) -> list[Local]:
    """sum of weight[t] over the targets t that are not ignore_index (their count without weights)."""
    counted = ctx.tmp()
    instrs = [Local("aten::ne.Scalar", (target, ignore), {}, (counted.id,))]
    if weight is not None:
        safe, picked, kept = ctx.tmp(), ctx.tmp(), ctx.tmp()
        instrs += [Local("aten::mul.Tensor", (target, counted), {}, (safe.id,)),
                   Local("aten::take", (weight, safe), {}, (picked.id,)),
                   Local("aten::mul.Tensor", (picked, counted), {}, (kept.id,))]
        counted = kept
    return instrs + [Local("aten::sum.default", (counted,), {"dtype": ctx.outs[1].dtype}, (out.id,))]


@register_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """Rows follow the batch shard: grad_output too for reduction none, else it is a replicated
    scalar; only mean reads total_weight (the last input), which must then be the global one."""
    reduction, tw = call.arg(4, "reduction"), call.ins[-1]
    total = R if reduction == MEAN else tw.placements[mdim]
    strategies = [Strategy(_rest(call, (P,))[:-1] + (total,), (P,))]
    for d, t in batch_pairs(call.ins[1]):
        g = Shard(t) if reduction == NONE else R
        strategies.append(Strategy(_rest(call, (g, Shard(d), Shard(t)))[:-1] + (total,), (Shard(d),)))
    return strategies


# -- dropout ----------------------------------------------------------------------------------------
@register_rule(aten.native_dropout.default)
def native_dropout(call: OpCall, mdim: int) -> list[Strategy]:
    """The mask is this rank's piece of one global draw (the same on any placement); the output is linear
    in the input, so a Partial input gives a Partial output with a replicated mask."""
    emit = None if call.arg(2, "train") is False else emit_dropout  # eval: the input and a mask of ones
    strategies = [Strategy((Shard(d),), (Shard(d),) * 2, emit) for d in range(call.ins[0].ndim)]
    return strategies + [Strategy((P,), (P, R), emit), Strategy((R,), (R, R), emit)]


def emit_dropout(ctx: Emit) -> list[Local]:
    """mask = u < 1 - p, output = input * mask / (1 - p), as torch's native_dropout."""
    keep = 1.0 - ctx.call.arg(1, "p")
    draw, u = uniform_piece(ctx, ctx.outs[1])
    out, mask = ctx.out_ids
    kept = ctx.tmp()
    return [draw, Local("aten::lt.Scalar", (u, keep), {}, (mask,)),
            Local("aten::mul.Tensor", (ctx.args[0], Buf(mask)), {}, (kept.id,)),
            Local("aten::mul.Scalar", (kept, 1.0 / keep if keep else 0.0), {}, (out,))]


# -- monarch::linear: F.linear on an input of 3 dims or more, kept whole ------------------------------
@register_rule(torch.ops.monarch.linear.default)
def linear(call: OpCall, mdim: int) -> list[Strategy]:
    """"...k,nk->...n" with every leading dim a letter of its own; the bias follows the output's last
    dim, and is Partial (kept on one rank) when the product is."""
    x, out = call.ins[0], call.outs[0]
    lead = "abcdefgh"[:x.ndim - 1]
    strategies = [Strategy((R, R, R)[:len(call.ins)], (R,), _emit_linear)]
    for ins, out_p in einsum_strategies(f"{lead}k,nk->{lead}n"):
        if len(call.ins) == 3:
            ins = (*ins, broadcast_shard(call.ins[2], out, out_p.dim) if isinstance(out_p, Shard) else out_p)
        strategies.append(Strategy(ins, (out_p,), _emit_linear))
    return strategies


def _emit_linear(ctx: Emit) -> list[Local]:
    return [Local("aten::linear", ctx.args, ctx.kwargs, ctx.out_ids)]


@register_rule(torch.ops.monarch.linear_weight_grad.default)
def linear_weight_grad(call: OpCall, mdim: int) -> list[Strategy]:
    """"...n,...k->nk": a sharded leading dim gives a Partial sum."""
    lead = "abcdefgh"[:call.ins[1].ndim - 1]
    return [Strategy(ins, (out,), _emit_weight_grad)
            for ins, out in [((R, R), R), *einsum_strategies(f"{lead}n,{lead}k->nk")]]


def _emit_weight_grad(ctx: Emit) -> list[Local]:
    lead = list(range(ctx.call.ins[1].ndim - 1))
    return [Local("aten::tensordot", (*ctx.args, lead, lead), {}, ctx.out_ids)]


# -- attention --------------------------------------------------------------------------------------

BATCH, HEADS, ROWS = 0, 1, 2  # dims of (B, H, L, E)


def _mask_placement(mask: Spec, full: tuple[int, ...], d: int) -> Placement:
    """How a mask broadcasting to `full` (B, Hq, L, S) is placed when dim d of the scores is sharded."""
    k = d - (len(full) - mask.ndim)
    return Shard(k) if k >= 0 and mask.shape[k] == full[d] else R


def _kv_heads_follow(q: Spec, k: Spec, mdim: int) -> bool:
    """Whether sharding heads on `mdim` gives every query-head piece exactly the kv heads it reads."""
    hq, hk = q.shape[HEADS], k.shape[HEADS]
    if hq == hk:
        return True
    group = hq // hk
    return aligned(q, HEADS, hk, mdim, lambda a, b: a == (b[0] * group, b[1] * group))


def _lead_kinds(call: OpCall) -> tuple[bool, ...]:
    """Per tensor input before the mask: True for query-shaped ones (they have the rows), else False."""
    if call.op is aten._scaled_dot_product_flash_attention_for_cpu.default:
        return (True, False, False)
    return (True, True, False, False, True, True)  # grad_out, q, k, v, out, logsumexp


def _scores_shape(q: Spec, k: Spec) -> tuple[int, ...]:
    return (q.shape[BATCH], q.shape[HEADS], q.shape[ROWS], k.shape[ROWS])


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention(call: OpCall, mdim: int) -> list[Strategy]:
    """Batch or heads sharded everywhere; query rows sharded when not causal (forward: output and
    logsumexp follow; backward: grad_q follows, grad_k and grad_v are Partial). Dropout would draw inside
    the kernel: with dropout_p > 0 the op runs replicated (F.scaled_dot_product_attention with dropout
    takes the math path on CPU, whose dropout mask is one global draw)."""
    backward = call.op is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    kinds = _lead_kinds(call)
    q, k = call.ins[kinds.index(True)], call.ins[kinds.index(False)]
    if q.ndim != 4 or call.arg(6 if backward else 3, "dropout_p", 0.0):
        return []
    mask = call.ins[len(kinds)] if len(call.ins) > len(kinds) else None
    full = _scores_shape(q, k)
    strategies = []
    for d in (BATCH, HEADS):
        if d == HEADS and not _kv_heads_follow(q, k, mdim):
            continue
        masked = () if mask is None else (_mask_placement(mask, full, d),)
        ins = tuple(Shard(d) for _ in kinds) + masked
        strategies.append(Strategy(ins, (Shard(d),) * len(call.outs), emit_attention))
    causal = call.arg(7 if backward else 4, "is_causal", False)
    if not causal:
        masked = () if mask is None else (_mask_placement(mask, full, ROWS),)
        ins = tuple(Shard(ROWS) if rows else R for rows in kinds) + masked
        outs = (Shard(ROWS), P, P) if backward else (Shard(ROWS), Shard(ROWS))
        strategies.append(Strategy(ins, outs, emit_attention))
    return strategies + _linear(call, mdim, backward, len(kinds), mask is not None)


def _linear(call: OpCall, mdim: int, backward: bool, n_lead: int, masked: bool) -> list[Strategy]:
    """The forward is linear in v (logsumexp does not read it), the backward in grad_out: a Partial sum
    there, with everything else replicated, passes through."""
    carrier = 0 if backward else 2
    if call.ins[carrier].placements[mdim] != P:
        return []
    ins = tuple(P if i == carrier else R for i in range(n_lead)) + (R,) * masked
    return [Strategy(ins, (P, P, P) if backward else (P, R))]


def emit_attention(ctx: Emit) -> list[Instr]:
    """The kernel, except on a rank whose queries or keys have no heads or rows (the CPU kernel divides
    by zero there): its outputs are zeros of their local shapes (a Partial key gradient's share is 0).
    Every rank emits as many instructions (the kernel's rank pads with empty Frees)."""
    kinds = _lead_kinds(ctx.call)
    q, k = ctx.ins[kinds.index(True)], ctx.ins[kinds.index(False)]
    if not any(0 in q.local_shape(c) or 0 in k.local_shape(c) for c in q.mesh.coords()):
        return ctx.default()
    if all(q.local_shape(ctx.coords)) and all(k.local_shape(ctx.coords)):
        return [*ctx.default(), *(Free(()) for _ in ctx.out_ids[1:])]
    src = ctx.args[kinds.index(True)]
    return [Local("aten::new_zeros", (src, list(ctx.local_out_shape(i))), {"dtype": ctx.outs[i].dtype}, (o,))
            for i, o in enumerate(ctx.out_ids)]


@register_rule(aten._safe_softmax.default)
def safe_softmax(call: OpCall, mdim: int) -> list[Strategy]:
    """softmax with fully masked rows giving zeros: any dim but the softmax dim stays sharded."""
    x = call.ins[0]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
