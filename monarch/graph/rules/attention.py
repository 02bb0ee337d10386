"""Rules for attention: the CPU flash kernels `F.scaled_dot_product_attention` dispatches to (forward and
backward) and `_safe_softmax`, which its math path (3-d inputs, a mask that needs a gradient) records.

Queries (B, Hq, L, E) attend to keys and values (B, Hk, S, E); batch and heads never mix, so either
stays sharded (grouped-query heads when each piece of query heads reads its own piece of kv heads).
Without a causal mask, query rows are independent too: they shard with keys and values replicated, and
the key and value gradients, sums over the rows, come out Partial. The mask broadcasts to (B, Hq, L, S).
The forward is linear in the values and the backward in grad_out, so a Partial sum there passes through.
"""
from __future__ import annotations

from monarch.graph.rules.common import aten
from monarch.graph.rules.table import Emit, OpCall, Strategy, register_rule
from monarch.graph.rules.view import aligned
from monarch.program.instr import Free, Instr, Local
from monarch.tensor.placement import P, Placement, R, Shard
from monarch.tensor.spec import Spec

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
