"""Rules for joining and indexing ops: cat, stack, index_select, gather, simple index.Tensor, index_add,
index_put, and the fixed-shape forms of data-dependent ones (nonzero_static, histc; see tensor/dynamic.py).

A data dim that is not joined or indexed keeps its shard when every tensor input is sharded alike on
it; a sharded index (with the data replicated) shards the output where the index's values land. The
ops are linear in the data, so `Partial` data with replicated indices passes through.
"""
from __future__ import annotations

import torch

from monarch.graph.rules.common import aten, kept, partials
from monarch.graph.rules.table import OpCall, Strategy, register_rule
from monarch.tensor.placement import Partial, R, Shard

SUM = Partial("sum")


@register_rule(aten.cat.default)
def cat(call: OpCall, mdim: int) -> list[Strategy]:
    """Every dim but the cat dim; legacy empty 1-d inputs (shape (0,)) stay replicated."""
    out = call.outs[0]
    dim = call.arg(1, "dim", 0) % out.ndim
    return [Strategy(tuple(Shard(d) if x.ndim == out.ndim else R for x in call.ins), (Shard(d),))
            for d in range(out.ndim) if d != dim] + partials(call, mdim)


@register_rule(aten.stack.default)
def stack(call: OpCall, mdim: int) -> list[Strategy]:
    out = call.outs[0]
    new = call.arg(1, "dim", 0) % out.ndim
    n = len(call.ins)
    return [Strategy((Shard(k),) * n, (Shard(k + (k >= new)),)) for k in range(out.ndim - 1)] + partials(call, mdim)


@register_rule(aten.index_select.default)
def index_select(call: OpCall, mdim: int) -> list[Strategy]:
    """(x, dim, index): x sharded off `dim` with the index replicated, or a sharded 1-d index."""
    x, index = call.ins
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    strategies = [Strategy((Shard(k), R), (Shard(k),)) for k in kept(x.ndim, dim, False)]
    if index.ndim == 1 and x.ndim:
        strategies.append(Strategy((R, Shard(0)), (Shard(dim),)))
    return strategies + partials(call, mdim, carriers=[0])


@register_rule(aten.gather.default)
def gather(call: OpCall, mdim: int) -> list[Strategy]:
    """(x, dim, index): dims off `dim` where x and index agree in size, or the index sharded on `dim`."""
    x, index = call.ins
    if not x.ndim or not index.ndim:
        return partials(call, mdim, carriers=[0])
    dim = call.arg(1, "dim") % x.ndim
    strategies = [Strategy((Shard(k), Shard(k)), (Shard(k),)) for k in kept(x.ndim, dim, False)
                  if x.shape[k] == index.shape[k]]
    strategies.append(Strategy((R, Shard(dim)), (Shard(dim),)))
    return strategies + partials(call, mdim, carriers=[0])


@register_rule(aten.index.Tensor)
def index(call: OpCall, mdim: int) -> list[Strategy]:
    """x[i0, i1, ...] with integer indices: dims left unindexed keep their shard; a lone index may be sharded."""
    x, out, idx = call.ins[0], call.outs[0], call.ins[1:]
    at = [d for d, t in enumerate(call.arg(1, "indices")) if t is not None]
    if not at or any(t.dtype in (torch.bool, torch.uint8) for t in idx):
        return []
    width = out.ndim - (x.ndim - len(at))  # dims of the broadcast index shape
    first = at[0] if at == list(range(at[0], at[-1] + 1)) else 0  # where those dims land in the output
    free = [d for d in range(x.ndim) if d not in at]
    strategies = [Strategy((Shard(d),) + (R,) * len(idx), (Shard(j if d < first else j + width),))
                  for j, d in enumerate(free)]
    if len(idx) == 1 and idx[0].ndim == width:
        strategies += [Strategy((R, Shard(k)), (Shard(first + k),)) for k in range(width)]
    return strategies + partials(call, mdim, carriers=[0])


@register_rule(aten.index_add.default, aten.index_add_.default)
def index_add(call: OpCall, mdim: int) -> list[Strategy]:
    """(x, dim, index, source): dims off `dim` sharded alike in x and source; or the index and source
    sharded along it, each rank adding its rows into a Partial x; Partial(sum) x and source pass through
    (a sum of pieces' maxima is not the maximum of the sum)."""
    x, index, source = call.ins
    if not x.ndim:
        return summed(partials(call, mdim, carriers=[0, 2]))
    dim = call.arg(1, "dim") % x.ndim
    strategies = [Strategy((Shard(k), R, Shard(k)), (Shard(k),)) for k in kept(x.ndim, dim, False)
                  if x.shape[k] == source.shape[k]]
    if index.ndim == 1 and source.ndim:
        strategies.append(Strategy((SUM, Shard(0), Shard(dim)), (SUM,)))
    return strategies + summed(partials(call, mdim, carriers=[0, 2]))


@register_rule(aten.index_put.default, aten.index_put_.default)
def index_put(call: OpCall, mdim: int) -> list[Strategy]:
    """x[indices] = values (or += with accumulate): a selection of x and values (any Partial passes through
    with the indices replicated; a replicated x or values joins as a Partial piece), or their sum (only
    Partial(sum) does)."""
    strategies = partials(call, mdim, carriers=[0, len(call.ins) - 1])
    return summed(strategies) if call.arg(3, "accumulate", False) else strategies


def summed(strategies: list[Strategy]) -> list[Strategy]:
    """The strategies whose output is Partial(sum)."""
    return [s for s in strategies if s.outputs[0] == SUM]


@register_rule(aten.nonzero_static.default)
def nonzero_static(call: OpCall, mdim: int) -> list[Strategy]:
    """Where the nonzeros of a piece land depends on the other pieces' counts: replicated only."""
    return []


@register_rule(aten.histc.default)
def histc(call: OpCall, mdim: int) -> list[Strategy]:
    """With a given range each rank counts its piece (the counts add up); a range taken from the data
    (min == max) needs the whole tensor."""
    x = call.ins[0]
    if call.arg(2, "min", 0) == call.arg(3, "max", 0):
        return []
    return [Strategy((Shard(d),), (SUM,)) for d in range(x.ndim)]
