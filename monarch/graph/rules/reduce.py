"""Rules for reductions (sum, mean, prod, amax/amin, max/min, argmax/argmin, var/std, any/all), for
ops along one dim (cumulative scans, sorts, topk, kthvalue, median, mode: shardable on every other dim)
and for lookups in a replicated table (searchsorted, bucketize, take, histogram counts: the kernels
tensor/data_dependent.py turns every histogram into, a sharded input's counts add up to a Partial sum).

A dim that is not reduced keeps its shard (renumbered when keepdim=False). Over a sharded reduced dim,
ops that combine per-piece results run on each piece and leave a Partial output: sum and mean give
P(sum), amax/max/any P(max), amin/min/all P(min), prod P(prod); a Partial input of that same kind
passes through. The others (argmax, max.dim's indices, var/std) gather their reduced dims.
"""
from __future__ import annotations

import torch

from monarch.graph.rules.common import aten
from monarch.graph.rules.common import kept as kept_dims
from monarch.graph.rules.common import partials
from monarch.graph.rules.table import Emit, Emitter, OpCall, OpOverload, Strategy, op_name, register_rule
from monarch.program.instr import Local
from monarch.tensor.placement import P, Partial, R, Shard

MAX, MIN, PROD = Partial("max"), Partial("min"), Partial("prod")

# ops whose pieces' results combine into the whole result, and how
COMBINE: dict[OpOverload, Partial] = {
    aten.all.default: MIN, aten.all.dim: MIN, aten.all.dims: MIN,
    aten.amax.default: MAX, aten.amin.default: MIN,
    aten.any.default: MAX, aten.any.dim: MAX, aten.any.dims: MAX,
    aten.max.default: MAX, aten.mean.default: P, aten.mean.dim: P, aten.min.default: MIN,
    aten.prod.default: PROD, aten.prod.dim_int: PROD, aten.sum.default: P, aten.sum.dim_IntList: P,
}
# ops that must see a reduced dim whole
GATHER = sorted([
    aten.argmax.default, aten.argmin.default, aten.max.dim, aten.median.default, aten.min.dim,
    aten.nanmedian.default,
    aten.std.correction, aten.std.default, aten.std.dim, aten.std_mean.correction, aten.std_mean.default,
    aten.std_mean.dim, aten.var.correction, aten.var.default, aten.var.dim, aten.var_mean.correction,
    aten.var_mean.default, aten.var_mean.dim,
], key=str)
EMPTY_MEANS_NONE = {aten.any.dims, aten.all.dims}  # dim=[] reduces nothing (elsewhere: everything)
MEANS = {aten.mean.default, aten.mean.dim}
EXTREMES = {aten.amax.default, aten.amin.default, aten.max.default, aten.min.default}  # fail on empty pieces


def reduction(call: OpCall) -> tuple[frozenset[int], bool]:
    """The input dims the op reduces, and its keepdim flag."""
    names = [a.name for a in call.op._schema.arguments]
    x = call.ins[0]
    dim = call.arg(names.index("dim"), "dim") if "dim" in names else None
    keep = bool(call.arg(names.index("keepdim"), "keepdim", False)) if "keepdim" in names else False
    if isinstance(dim, int):
        dim = [dim]
    if dim is None or (not dim and call.op not in EMPTY_MEANS_NONE):
        dim = range(x.ndim)
    return frozenset(d % x.ndim for d in dim) if x.ndim else frozenset(), keep


def out_dim(d: int, reduced: frozenset[int], keep: bool) -> int:
    """Where input dim d (not reduced) lands in the output."""
    return d if keep else d - sum(r < d for r in reduced)


def kept(call: OpCall, mdim: int) -> list[Strategy]:
    """A shard of a dim the op does not reduce stays on that dim of every output (the whole rule of
    the ops that gather their reduced dims)."""
    reduced, keep = reduction(call)
    n_out = len(call.outs)
    return [Strategy((Shard(d),), (Shard(out_dim(d, reduced, keep)),) * n_out)
            for d in range(call.ins[0].ndim) if d not in reduced]


def combined(call: OpCall, mdim: int) -> list[Strategy]:
    """Kept shards; a sharded reduced dim gives COMBINE[op]; a Partial of that kind passes through."""
    x, out = call.ins[0], call.outs[0]
    partial = COMBINE[call.op]
    strategies = kept(call, mdim)
    strategies += [Strategy((Shard(d),), (partial,), EMITTERS.get(call.op)) for d in sorted(reduction(call)[0])]
    if x.placements[mdim] == partial and (x.dtype == torch.bool) == (out.dtype == torch.bool):
        strategies.append(Strategy((partial,), (partial,)))
    return strategies


def emit_mean(ctx: Emit) -> list[Local]:
    """sum over the local piece divided by the global count: a correct P(sum) even for uneven shards."""
    reduced, keep = reduction(ctx.call)
    x = ctx.call.ins[0]
    count = 1
    for d in reduced:
        count *= x.shape[d]
    dtype = ctx.kwargs.get("dtype")
    tmp = ctx.tmp()
    return [Local("aten::sum.dim_IntList", (ctx.args[0], sorted(reduced), keep),
                  {"dtype": dtype} if dtype is not None else {}, (tmp.id,)),
            Local("aten::div.Scalar", (tmp, count), {}, ctx.out_ids)]


def emit_extreme(ctx: Emit) -> list[Local]:
    """amax/amin/max/min; when some rank's piece of a reduced dim is empty, every rank first pads its
    piece with the identity of the reduction (one element on empty reduced dims, none elsewhere)."""
    reduced, _ = reduction(ctx.call)
    x = ctx.ins[0]
    if not any(x.local_shape(c)[d] == 0 for c in x.mesh.coords() for d in reduced):
        return ctx.default()
    local = x.local_shape(ctx.coords)
    pads = [p for d in reversed(range(x.ndim)) for p in (0, int(d in reduced and local[d] == 0))]
    tmp = ctx.tmp()
    fill = identity(x.dtype, COMBINE[ctx.call.op].op)
    return [Local("aten::constant_pad_nd", (ctx.args[0], pads, fill), {}, (tmp.id,)),
            Local(op_name(ctx.call.op), (tmp, *ctx.args[1:]), ctx.kwargs, ctx.out_ids)]


def identity(dtype: torch.dtype, op: str) -> bool | int | float:
    """The value that max (op="max") or min (op="min") ignores."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


EMITTERS: dict[OpOverload, Emitter] = {**{op: emit_mean for op in MEANS}, **{op: emit_extreme for op in EXTREMES}}

for _op in sorted(COMBINE, key=str):
    register_rule(_op)(combined)
for _op in GATHER:
    register_rule(_op)(kept)


# -- along one dim ----------------------------------------------------------------------------------
ALONG = sorted([
    aten.argsort.default, aten.argsort.stable, aten.cummax.default, aten.cummin.default, aten.cumprod.default,
    aten.cumsum.default, aten.kthvalue.default, aten.logcumsumexp.default, aten.median.dim, aten.mode.default,
    aten.nanmedian.dim, aten.sort.default, aten.sort.stable, aten.topk.default,
], key=str)
LINEAR_ALONG = {aten.cumsum.default}


def schema_arg(call: OpCall, name: str, absent: object) -> object:
    """Argument `name` as passed or as the schema defaults it (`absent` when the op has no such argument)."""
    args = call.op._schema.arguments
    i = next((k for k, a in enumerate(args) if a.name == name), None)
    if i is None:
        return absent
    default = args[i].default_value if args[i].has_default_value() else None
    return call.arg(i, name, default)


def along(call: OpCall, mdim: int) -> list[Strategy]:
    """Every dim but the op's `dim` keeps its shard on every output (renumbered when keepdim=False drops
    it); cumsum is linear, so a Partial input passes through."""
    x = call.ins[0]
    dim = int(schema_arg(call, "dim", -1)) % max(x.ndim, 1)
    drops = not schema_arg(call, "keepdim", True)
    n_out = len(call.outs)
    strategies = [Strategy((Shard(k),), (Shard(v),) * n_out) for k, v in kept_dims(x.ndim, dim, drops).items()]
    if call.op in LINEAR_ALONG and x.placements[mdim] == P:
        strategies.append(Strategy((P,), (P,)))
    return strategies


for _op in ALONG:
    register_rule(_op)(along)


@register_rule(aten.searchsorted.Tensor)
def searchsorted(call: OpCall, mdim: int) -> list[Strategy]:
    """A 1-D sorted sequence (and sorter) replicated: the values shard on any dim. An N-D one searches
    along its last dim: its other dims shard with those of the values."""
    seq, values = call.ins[:2]
    sorter = len(call.ins) - 2
    if seq.ndim == 1:
        return [Strategy((R, Shard(d), *(R,) * sorter), (Shard(d),)) for d in range(values.ndim)]
    return [Strategy((Shard(d),) * (2 + sorter), (Shard(d),)) for d in range(seq.ndim - 1)]


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
