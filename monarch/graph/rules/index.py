"""Rules for joining, indexing and scattering ops: cat, stack, index_select, gather, index.Tensor, index_add/put,
scatter(_add/_reduce), index_reduce, put, masked_scatter, grid_sampler_2d/3d, segment_reduce (with backward ops),
nonzero_static and histc. A dim not joined, indexed or scattered along keeps its shard where all inputs agree on it;
a sharded index shards the output where its values land, or on a scatter dim adds its share into a Partial self when
the reduction includes self. Selections and sums of the data pass its Partials (any kind, or only sums) through."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from monarch.graph.rules.common import aten, kept, partials, summed
from monarch.graph.rules.table import Emit, OpCall, Strategy, register_rule
from monarch.program.instr import Local
from monarch.tensor.placement import Partial, Placement, R, Shard
from monarch.tensor.spec import Spec

SUM, PROD, MAX, MIN = Partial("sum"), Partial("prod"), Partial("max"), Partial("min")


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


# -- scatter ----------------------------------------------------------------------------------------
# the Partial that combines pieces of the contributions (only when the reduction includes self)
COMBINE: dict[str, Partial] = {"sum": SUM, "add": SUM, "prod": PROD, "multiply": PROD, "amax": MAX, "amin": MIN}
# the Partials that pass through self and src together, by reduction ("" overwrites: a selection)
THROUGH: dict[str, tuple[Partial, ...]] = {"": (SUM, MAX, MIN), "sum": (SUM,), "add": (SUM,), "mean": (SUM,),
                                           "amax": (MAX,), "amin": (MIN,)}

SCATTERS = sorted([
    aten.scatter.reduce, aten.scatter.src, aten.scatter.value, aten.scatter.value_reduce,
    aten.scatter_.reduce, aten.scatter_.src, aten.scatter_.value, aten.scatter_.value_reduce,
    aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two,
], key=str)


def through(call: OpCall, mdim: int, carriers: Sequence[int], kinds: Sequence[Partial]) -> list[Strategy]:
    """`P -> P` with the carriers placed alike (the other inputs replicated), for each Partial of `kinds`
    that a carrier already holds."""
    found = sorted({call.ins[i].placements[mdim] for i in carriers} & set(kinds), key=repr)
    return [Strategy(tuple(p if i in carriers else R for i in range(len(call.ins))), (p,)) for p in found]


def through_kinds(reduce: str, dtype: torch.dtype) -> tuple[Partial, ...]:
    """THROUGH[reduce]; an integer mean divides with rounding, which is not linear."""
    if reduce == "mean" and not dtype.is_floating_point:
        return ()
    return THROUGH.get(reduce, ())


def combine(reduce: str, include_self: bool, dtype: torch.dtype) -> Partial | None:
    """The Partial that joins per-rank results of pieces of the contributions, if any is exact."""
    return COMBINE.get(reduce) if include_self and dtype != torch.bool else None


def scatter_reduction(call: OpCall) -> tuple[str, bool]:
    """The scatter's reduction ("" when it overwrites) and whether it includes self's values."""
    name = call.name
    if name.startswith("scatter_add"):
        return "sum", True
    if name.startswith("scatter_reduce"):
        return call.arg(4, "reduce"), bool(call.arg(5, "include_self", True))
    return call.arg(4, "reduce", "") or "", True


def aligned(x: Spec, others: Sequence[Spec], skip: int) -> list[int]:
    """Dims of x but `skip` on which every one of `others` has x's size."""
    return [k for k in range(x.ndim) if k != skip and all(o.shape[k] == x.shape[k] for o in others)]


@register_rule(*SCATTERS)
def scatter(call: OpCall, mdim: int) -> list[Strategy]:
    """(self, dim, index, src | value[, reduce]): see the module docstring."""
    x, index, *src = call.ins
    reduce, include_self = scatter_reduction(call)
    strategies = []
    if x.ndim and all(t.ndim == x.ndim for t in call.ins):
        dim = call.arg(1, "dim") % x.ndim
        n = len(call.ins)
        strategies = [Strategy((Shard(k),) * n, (Shard(k),)) for k in aligned(x, call.ins[1:], dim)]
        joined = combine(reduce, include_self, x.dtype)
        if joined is not None and all(s.shape[dim] == index.shape[dim] for s in src):
            strategies.append(Strategy((joined,) + (Shard(dim),) * (n - 1), (joined,)))
    if src:
        strategies += through(call, mdim, (0, 2), through_kinds(reduce, x.dtype))
    return strategies


@register_rule(aten.index_reduce.default, aten.index_reduce_.default)
def index_reduce(call: OpCall, mdim: int) -> list[Strategy]:
    """(self, dim, index, source, reduce, include_self): dims off `dim` shard self and source; the index
    and source's rows split over ranks combine when the reduction includes self."""
    x, index, source = call.ins
    reduce, include_self = call.arg(4, "reduce"), bool(call.arg(5, "include_self", True))
    strategies = []
    if x.ndim and source.ndim == x.ndim and index.ndim == 1:
        dim = call.arg(1, "dim") % x.ndim
        strategies = [Strategy((Shard(k), R, Shard(k)), (Shard(k),)) for k in kept(x.ndim, dim, False)
                      if source.shape[k] == x.shape[k]]
        joined = combine(reduce, include_self, x.dtype)
        if joined is not None:
            strategies.append(Strategy((joined, Shard(0), Shard(dim)), (joined,)))
    return strategies + through(call, mdim, (0, 2), through_kinds(reduce, x.dtype))


@register_rule(aten.put.default, aten.put_.default)
def put(call: OpCall, mdim: int) -> list[Strategy]:
    """(self, index, source, accumulate): flat indices into the whole self. Accumulating, index and
    source pieces add into a Partial self; overwriting (duplicates may pick any writer) stays replicated."""
    x, index, source = call.ins
    if not call.arg(3, "accumulate", False) or x.dtype == torch.bool:
        return []
    strategies = [Strategy((SUM, Shard(j), Shard(j)), (SUM,)) for j in range(index.ndim)
                  if index.shape == source.shape]
    return strategies + through(call, mdim, (0, 2), (SUM,))


@register_rule(aten.masked_scatter.default, aten.masked_scatter_.default)
def masked_scatter(call: OpCall, mdim: int) -> list[Strategy]:
    """Where each element of source lands depends on the mask before it: no shard; a selection of self
    and source, so their Partials pass through with the mask replicated."""
    return through(call, mdim, (0, 2), THROUGH[""])


@register_rule(aten.masked_scatter_backward.default)
def masked_scatter_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad_output, mask, sizes): the masked elements in order, zero-padded: a selection of grad_output."""
    return through(call, mdim, (0,), THROUGH[""])


# -- grid sampling ----------------------------------------------------------------------------------
@register_rule(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(call: OpCall, mdim: int) -> list[Strategy]:
    """input (N, C, *S), grid (N, *S_out, k) -> (N, C, *S_out): the batch shards both, the channels the
    input, the grid's spatial dims the output's; linear in the input, so its Partial passes through."""
    grid = call.ins[1]
    strategies = [Strategy((Shard(0), Shard(0)), (Shard(0),)), Strategy((Shard(1), R), (Shard(1),))]
    strategies += [Strategy((R, Shard(d)), (Shard(d + 1),)) for d in range(1, grid.ndim - 1)]
    return strategies + through(call, mdim, (0,), (SUM,))


@register_rule(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad_output, input, grid, ..., output_mask) -> (grad_input, grad_grid) as the mask asks: the
    gradient of what a shard did not split (the input over sampled points, the grid over channels)
    sums over the ranks: Partial. Both are linear in grad_output."""
    grid = call.ins[2]
    mask = call.arg(6, "output_mask")

    def outs(grad_input: Placement, grad_grid: Placement) -> tuple[Placement, ...]:
        return tuple(p for p, on in zip((grad_input, grad_grid), mask, strict=True) if on)
    strategies = [Strategy((Shard(0),) * 3, outs(Shard(0), Shard(0))),
                  Strategy((Shard(1), Shard(1), R), outs(Shard(1), SUM))]
    strategies += [Strategy((Shard(d + 1), R, Shard(d)), outs(SUM, Shard(d))) for d in range(1, grid.ndim - 1)]
    if call.ins[0].placements[mdim] == SUM:
        strategies.append(Strategy((SUM, R, R), outs(SUM, SUM)))
    return strategies


# -- segments ---------------------------------------------------------------------------------------
def segment_axis(call: OpCall, data: Spec) -> int:
    return call.kwargs.get("axis", 0) % max(data.ndim, 1)


@register_rule(aten.segment_reduce.default)
def segment_reduce(call: OpCall, mdim: int) -> list[Strategy]:
    """data (..., L, ...) with lengths or offsets (data's dims before `axis`, then segments): any dim but
    `axis` shards data and output; a dim before `axis` shards lengths/offsets too."""
    data, *segments = call.ins
    axis = segment_axis(call, data)
    return [Strategy((Shard(k), *(Shard(k) if k < axis else R for _ in segments)), (Shard(k),), emit_segments)
            for k in range(data.ndim) if k != axis]


@register_rule(aten._segment_reduce_backward.default)
def segment_reduce_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad, output, data, reduce, lengths/offsets, axis): the forward's dims, grad and output alike."""
    data, segments = call.ins[2], call.ins[3:]
    axis = segment_axis(call, data)
    return [Strategy((Shard(k),) * 3 + tuple(Shard(k) if k < axis else R for _ in segments), (Shard(k),),
                     emit_segments) for k in range(data.ndim) if k != axis]


def emit_segments(ctx: Emit) -> list[Local]:
    """The op; a rank whose piece of the output is empty makes it with new_zeros instead (torch refuses
    segments of an empty piece)."""
    shape = ctx.local_out_shape()
    if math.prod(shape):
        return ctx.default()
    return [Local("aten::new_zeros", (ctx.args[0], list(shape)), {"dtype": ctx.outs[0].dtype}, ctx.out_ids)]
