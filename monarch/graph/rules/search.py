"""Rules for ops that look values up in a small replicated table: bucketize, take, and the counting
kernels of histograms (histogram.bins_tensor, _histogramdd_from_bin_tensors; tensor/dynamic.py turns
every histogram into them).

Looked-up values keep their shard; counts of a sharded input are added up (a Partial sum output).
"""
from __future__ import annotations

from monarch.graph.rules.common import aten, partials
from monarch.graph.rules.table import OpCall, Strategy, register_rule
from monarch.tensor.placement import P, R, Shard


@register_rule(aten.bucketize.Tensor)
def bucketize(call: OpCall, mdim: int) -> list[Strategy]:
    """(values, boundaries): the boundaries replicated, the values sharded on any dim."""
    return [Strategy((Shard(d), R), (Shard(d),)) for d in range(call.ins[0].ndim)]


@register_rule(aten.take.default)
def take(call: OpCall, mdim: int) -> list[Strategy]:
    """(x, index) -> x.flatten()[index]: the index sharded on any dim with x replicated; linear in x,
    so a Partial x passes through with the index replicated."""
    return [Strategy((R, Shard(d)), (Shard(d),)) for d in range(call.ins[1].ndim)] + partials(call, mdim, [0])


@register_rule(aten.histogram.bins_tensor)
def histogram(call: OpCall, mdim: int) -> list[Strategy]:
    """(x, edges, weight?) -> (counts, edges): each rank counts its piece of x (any dim, the weight
    sharded alike); counts are linear in the weight, so a Partial weight passes through. Density
    (counts over their total) needs the whole counts."""
    return [] if call.kwargs.get("density") else counted(call, mdim, range(call.ins[0].ndim), 1, 1)


@register_rule(aten._histogramdd_from_bin_tensors.default)
def histogramdd(call: OpCall, mdim: int) -> list[Strategy]:
    """(x of (..., N), N edge tensors, weight of (...)?): x sharded off its last dim."""
    if call.kwargs.get("density"):
        return []
    return counted(call, mdim, range(max(call.ins[0].ndim - 1, 0)), len(call.arg(1, "bins")), 0)


def counted(call: OpCall, mdim: int, dims: range, n_edges: int, n_edge_outs: int) -> list[Strategy]:
    """x (and the weight, when given) sharded on one of `dims` -> P counts, the edges replicated."""
    weighted = len(call.ins) > 1 + n_edges
    edges, edge_outs = (R,) * n_edges, (R,) * n_edge_outs
    strategies = [Strategy((Shard(d), *edges, *(Shard(d),) * weighted), (P, *edge_outs)) for d in dims]
    if weighted and call.ins[-1].placements[mdim] == P:
        strategies.append(Strategy((R, *edges, P), (P, *edge_outs)))
    return strategies
