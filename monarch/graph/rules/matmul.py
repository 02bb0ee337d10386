"""Rules for matmul-like ops, written as einsum strings: mm, bmm, addmm, baddbmm, addbmm, dot, mv, addmv,
and _trilinear (nn.functional.bilinear), whose string comes from its expand and sum dims.

From "mk,kn->mn": sharding a letter kept in the output shards every operand that has it; sharding a
contracted letter shards both operands on it and leaves a `Partial(sum)` output; the op is linear in
each operand, so `Partial` passes through when the other operands are replicated. An additive term
(`addmm`'s bias) follows the output, and becomes Partial (kept on one rank) when the product is.
"""
from __future__ import annotations

import torch

import monarch.tensor.ops  # noqa: F401 - defines torch.ops.monarch.matmul
from monarch.graph.rules.common import aten, broadcast_shard
from monarch.graph.rules.table import OpCall, Strategy, register_rule
from monarch.tensor.placement import P, Placement, R, Shard

EINSUM = {
    aten.mm.default: "mk,kn->mn",
    aten.bmm.default: "bmk,bkn->bmn",
    aten.dot.default: "k,k->",
    aten.mv.default: "mk,k->m",
    aten.addmm.default: "mk,kn->mn",
    aten.baddbmm.default: "bmk,bkn->bmn",
    aten.addmv.default: "mk,k->m",
    aten.addbmm.default: "bmk,bkn->mn",
}
# first input is added to the product
ADDITIVE = {aten.addmm.default, aten.baddbmm.default, aten.addbmm.default, aten.addmv.default}


def einsum_strategies(eq: str) -> list[tuple[tuple[Placement, ...], Placement]]:
    """(operand placements, output placement) for every letter of `eq`, plus the linear Partial ones."""
    lhs, out = eq.split("->")
    operands = lhs.split(",")
    result: list[tuple[tuple[Placement, ...], Placement]] = []
    for letter in sorted(set(lhs.replace(",", ""))):
        ins = tuple(Shard(op.index(letter)) if letter in op else R for op in operands)
        result.append((ins, Shard(out.index(letter)) if letter in out else P))
    for i in range(len(operands)):
        result.append((tuple(P if j == i else R for j in range(len(operands))), P))
    return result


def _term_placement(call: OpCall, out_p: Placement) -> Placement:
    """How the additive input must be placed to match an output placed `out_p` (it broadcasts)."""
    if isinstance(out_p, Shard):
        return broadcast_shard(call.ins[0], call.outs[0], out_p.dim)
    return out_p


@register_rule(torch.ops.monarch.matmul.default)
def batched_matmul(call: OpCall, mdim: int) -> list[Strategy]:
    """`monarch::matmul`: "...mk,...kn->...mn" with the batch dims as letters of their own."""
    batch = "abcdefgh"[:call.ins[0].ndim - 2]
    return [Strategy(ins, (out,)) for ins, out in einsum_strategies(f"{batch}mk,{batch}kn->{batch}mn")]


@register_rule(*EINSUM)
def matmul(call: OpCall, mdim: int) -> list[Strategy]:
    strategies = []
    for ins, out_p in einsum_strategies(EINSUM[call.op]):
        if call.op in ADDITIVE:
            ins = (_term_placement(call, out_p), *ins)
        strategies.append(Strategy(ins, (out_p,)))
    return strategies


@register_rule(aten._trilinear.default)
def trilinear(call: OpCall, mdim: int) -> list[Strategy]:
    """i1, i2, i3 unsqueezed at their `expand` dims, multiplied and summed over `sumdim`: one letter per
    dim of the product, each operand lacking its expanded ones, the output lacking the summed ones. A
    letter some operand broadcasts along (size 1 against a larger size) is not sharded."""
    ndim = call.ins[0].ndim + len(call.arg(3, "expand1"))
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    operands = ["".join(c for d, c in enumerate(letters) if d not in set(call.arg(k, f"expand{k - 2}")))
                for k in (3, 4, 5)]
    sizes: dict[str, set[int]] = {}
    for spec, op in zip(call.ins, operands, strict=True):
        for c, n in zip(op, spec.shape, strict=True):
            sizes.setdefault(c, set()).add(n)
    summed = set(call.arg(6, "sumdim"))
    eq = f"{','.join(operands)}->{''.join(c for d, c in enumerate(letters) if d not in summed)}"
    return [Strategy(ins, (out,)) for ins, out in einsum_strategies(eq)
            if all(len(sizes[op[p.dim]]) == 1 for op, p in zip(operands, ins) if isinstance(p, Shard))]
