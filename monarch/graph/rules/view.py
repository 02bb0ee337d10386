"""Rules for view and shape ops: view, expand, transpose/t/permute, squeeze/unsqueeze (and in place),
slice, select, split/unbind (unsafe and copying forms too), diagonal, unfold, rev (flip) and as_strided.

A shard survives when its dim maps to an output dim whose pieces are exactly the images of the input's
pieces, checked for every nesting over mesh dims (uneven pieces included); otherwise that dim must be
replicated. These ops only move data, so they pass `Partial` through. Size and slice arguments are
global: their emitters rewrite them per rank.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch

from monarch.graph.rules.common import aten, kept, partials, resized
from monarch.graph.rules.table import RULES, Emit, Emitter, OpCall, Strategy, op_name, register_rule
from monarch.program.instr import Local
from monarch.tensor.placement import R, Shard, local_bounds
from monarch.tensor.spec import Spec

Range = tuple[int, int]  # (start, length) of a piece along one dim
Match = Callable[[Range, Range], bool]

PERMUTING = sorted([aten.permute.default, aten.t.default, aten.transpose.int], key=str)
RESHAPING = sorted([aten._unsafe_view.default, aten.view.default], key=str)
SQUEEZING = sorted([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims], key=str)
DROPS = {aten.select.int, aten.unbind.int, aten.unbind_copy.int}  # ops whose output loses `dim`
DROPPING = sorted([aten.select.int, aten.split.Tensor, aten.split.default, aten.split.sizes,
                   aten.split_with_sizes.default, aten.split_with_sizes_copy.default, aten.unbind.int,
                   aten.unbind_copy.int, aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default], key=str)
IN_PLACE_VIEWS = {aten.squeeze_.default: aten.squeeze.default, aten.squeeze_.dim: aten.squeeze.dim,
                  aten.squeeze_.dims: aten.squeeze.dims, aten.unsqueeze_.default: aten.unsqueeze.default,
                  aten.transpose_.default: aten.transpose.int, aten.t_.default: aten.t.default}
prims = torch.ops.prims
DIAGONALS = sorted([aten.diagonal.default, aten.diagonal_copy.default], key=str)
UNFOLDS = sorted([aten.unfold.default, aten.unfold_copy.default], key=str)
AS_STRIDED = sorted([aten.as_strided.default, aten.as_strided_copy.default], key=str)
AS_STRIDED_SCATTERS = sorted([aten.as_strided_scatter.default, prims.as_strided_scatter.default], key=str)
COPYING_VIEWS = frozenset({aten.as_strided.default})  # views whose local kernel reads a copy of the piece


# -- shards that survive a change of dim size ---------------------------------------------------------
def aligned(x: Spec, i: int, n_out: int, mdim: int, match: Match) -> bool:
    """Whether mesh dim `mdim` may map a shard of x's dim i onto an output dim of n_out elements.

    `match(input piece, output piece)` must hold at every mesh point for every set of mesh dims that may
    shard dim i together (nesting in mesh-dim order). Mesh dims are admitted one at a time, those that
    shard dim i now first, each only if every nest it forms with those admitted before it matches.
    """
    sizes = x.mesh.sizes
    if sizes[mdim] == 1:
        return True
    order = sorted((e for e, k in enumerate(sizes) if k > 1), key=lambda e: (x.placements[e] != Shard(i), e))
    admitted: list[int] = []
    for e in order:
        if all(_nest_matches(x.shape[i], n_out, sizes, sorted((e, *t)), match)
               for r in range(len(admitted) + 1) for t in itertools.combinations(admitted, r)):
            admitted.append(e)
        if e == mdim:
            return e in admitted
    raise AssertionError(f"mesh dim {mdim} of sizes {sizes} not visited")


def _nest_matches(n_in: int, n_out: int, sizes: Sequence[int], nest: list[int], match: Match) -> bool:
    ks = [sizes[e] for e in nest]
    shards = (Shard(0),) * len(ks)
    for coords in itertools.product(*(range(k) for k in ks)):
        a = local_bounds((n_in,), shards, ks, coords)[0]
        b = local_bounds((n_out,), shards, ks, coords)[0]
        if not (a[1] == b[1] == 0 or match(a, b)):
            return False
    return True


def follow(call: OpCall, mdim: int, dims: dict[int, int], emit: Emitter | None = None) -> list[Strategy]:
    """One-input data movement: `S(i) -> S(dims[i])` on every output, plus Partial pass-through."""
    n_out = len(call.outs)
    moved = [Strategy((Shard(i),), (Shard(o),) * n_out, emit) for i, o in sorted(dims.items())]
    return moved + partials(call, mdim, emit=emit)


# -- view / _unsafe_view / view.dtype ----------------------------------------------------------------
def view_dims(x: Spec, dst: Sequence[int], mdim: int) -> dict[int, int]:
    """Input dim -> output dim whose pieces hold exactly the same elements (same outer product, aligned)."""
    found = {}
    src = x.shape
    for i, n in enumerate(src):
        outer, inner = math.prod(src[:i]), math.prod(src[i + 1:])
        for o, m in enumerate(dst):
            inner_o = math.prod(dst[o + 1:])
            if (n > 1 and m > 1 and math.prod(dst[:o]) == outer and n * inner == m * inner_o
                    and aligned(x, i, m, mdim, _blocks(inner, inner_o))):
                found[i] = o
                break
    return found


def _blocks(inner_in: int, inner_out: int) -> Match:
    return lambda a, b: (a[0] * inner_in, a[1] * inner_in) == (b[0] * inner_out, b[1] * inner_out)


@register_rule(*RESHAPING)
def view(call: OpCall, mdim: int) -> list[Strategy]:
    x, out = call.ins[0], call.outs[0]
    replicated = Strategy((R,), (R,), _reshape_emit)
    return follow(call, mdim, view_dims(x, out.shape, mdim), _reshape_emit) + [replicated]


def _reshape_emit(ctx: Emit) -> list[Local]:
    """A piece may be laid out unlike the global tensor (a redistribution's output is contiguous, and
    kernels such as SDPA lay out their output like their input), so a view torch allowed on the global
    strides may not exist locally: the piece is reshaped, which views it whenever its strides allow."""
    return resized(ctx, "aten::reshape")


@register_rule(aten.view.dtype)
def view_dtype(call: OpCall, mdim: int) -> list[Strategy]:
    """Reinterpreting bits: the last dim scales by the itemsize ratio; not linear, so no Partial.

    Viewing as a wider dtype fails on an empty piece (its strides are arbitrary), so then every piece of
    the last dim must be whole and non-empty: divisible by the ratio times the mesh size.
    """
    x, out = call.ins[0], call.outs[0]
    dims = {k: k for k in range(x.ndim - 1)}
    grow = out.dtype.itemsize // x.dtype.itemsize
    last = x.ndim - 1
    if x.ndim and (x.shape[last] % (grow * x.mesh.nelements) == 0 if grow > 1 else
                   aligned(x, last, out.shape[last], mdim, _blocks(x.dtype.itemsize, out.dtype.itemsize))):
        dims[last] = last
    return [Strategy((Shard(i),), (Shard(o),)) for i, o in dims.items()]


# -- expand, permutations, squeeze, unsqueeze --------------------------------------------------------
@register_rule(aten.expand.default)
def expand(call: OpCall, mdim: int) -> list[Strategy]:
    x, out = call.ins[0], call.outs[0]
    off = out.ndim - x.ndim
    dims = {k: k + off for k, n in enumerate(x.shape) if n > 1 and n == out.shape[k + off]}
    return follow(call, mdim, dims, resized)


@register_rule(*PERMUTING)
def permute(call: OpCall, mdim: int) -> list[Strategy]:
    return follow(call, mdim, {src: dst for dst, src in enumerate(_permutation(call))})


def _permutation(call: OpCall) -> list[int]:
    """perm[j]: the input dim that output dim j comes from."""
    n = call.ins[0].ndim
    perm = list(range(n))
    if call.op == aten.permute.default:
        return [d % n for d in call.arg(1, "dims")]
    if call.op in (aten.transpose.int, aten.transpose_.default):
        a, b = call.arg(1, "dim0") % max(n, 1), call.arg(2, "dim1") % max(n, 1)
    else:
        a, b = (0, 1) if n == 2 else (0, 0)
    if n:
        perm[a], perm[b] = perm[b], perm[a]
    return perm


@register_rule(*SQUEEZING)
def squeeze(call: OpCall, mdim: int) -> list[Strategy]:
    """Only dims of global size 1 go; the kernel names them, since a piece may have size 1 elsewhere."""
    x = call.ins[0]
    gone = _squeezed(call)
    dims = {k: k - sum(g < k for g in gone) for k in range(x.ndim) if k not in gone}
    return follow(call, mdim, dims, _squeeze_emit)


def _squeezed(call: OpCall) -> list[int]:
    x = call.ins[0]
    asked: Iterable[int]
    if call.op in (aten.squeeze.default, aten.squeeze_.default):
        asked = range(x.ndim)
    elif call.op in (aten.squeeze.dim, aten.squeeze_.dim):
        asked = [call.arg(1, "dim")]
    else:
        asked = call.arg(1, "dim")
    return sorted({d % x.ndim for d in asked if x.ndim and x.shape[d % x.ndim] == 1})


def _squeeze_emit(ctx: Emit) -> list[Local]:
    return [Local("aten::squeeze.dims", (ctx.args[0], _squeezed(ctx.call)), {}, ctx.out_ids)]


@register_rule(aten.unsqueeze.default)
def unsqueeze(call: OpCall, mdim: int) -> list[Strategy]:
    x = call.ins[0]
    new = call.arg(1, "dim") % (x.ndim + 1)
    return follow(call, mdim, {k: k + (k >= new) for k in range(x.ndim)})


@register_rule(*sorted(IN_PLACE_VIEWS, key=str))
def in_place_view(call: OpCall, mdim: int) -> list[Strategy]:
    """squeeze_, unsqueeze_, transpose_, t_: the rule of the plain view; each rank runs the plain view on
    its piece (a new local tensor, as in torch only the target's shape changes, never a view sharing it)."""
    plain = replace(call, op=IN_PLACE_VIEWS[call.op])
    return [Strategy(s.inputs, s.outputs, functools.partial(_as_plain, s.emit)) for s in RULES[plain.op](plain, mdim)]


def _as_plain(emit: Emitter | None, ctx: Emit) -> list[Local]:
    ctx = replace(ctx, call=replace(ctx.call, op=IN_PLACE_VIEWS[ctx.call.op]))
    return emit(ctx) if emit is not None else ctx.default()


# -- slice, select, unbind, split --------------------------------------------------------------------
@register_rule(aten.slice.Tensor)
def slice_(call: OpCall, mdim: int) -> list[Strategy]:
    """Other dims keep their shard; the sliced dim too when each piece's slice is the output's piece."""
    x, out = call.ins[0], call.outs[0]
    dim, start, step = _slice_args(call)
    dims = {k: k for k in range(x.ndim)}
    m = out.shape[dim]
    if not aligned(x, dim, m, mdim, lambda a, b: _image(a, start, step, m) == b):
        del dims[dim]
    return follow(call, mdim, dims, _slice_emit)


def _slice_args(call: OpCall) -> tuple[int, int, int]:
    """(dim, first index, step) of a slice call, with torch's clamping of start and end."""
    x = call.ins[0]
    dim = call.arg(1, "dim", 0) % x.ndim
    step = call.arg(4, "step", 1)
    start, _, _ = slice(call.arg(2, "start"), call.arg(3, "end"), step).indices(x.shape[dim])
    return dim, start, step


def _image(piece: Range, start: int, step: int, m: int) -> Range:
    """Output indices t in [0, m) whose source start + t*step lies in the input piece."""
    s, n = piece
    lo = min(max(-(-(s - start) // step), 0), m)
    hi = min(max(-(-(s + n - start) // step), 0), m)
    return lo, max(hi - lo, 0)


def _slice_emit(ctx: Emit) -> list[Local]:
    """This rank's slice of its own piece: the output piece's first source index, relative to the piece."""
    dim, start, step = _slice_args(ctx.call)
    s_in = ctx.ins[0].bounds(ctx.coords)[dim][0]
    s_out, n_out = ctx.outs[0].bounds(ctx.coords)[dim]
    first = start + s_out * step - s_in if n_out else 0
    end = first + (n_out - 1) * step + 1 if n_out else 0
    return [Local(op_name(ctx.call.op), (ctx.args[0], dim, first, end, step), {}, ctx.out_ids)]


@register_rule(*DROPPING)
def select_split(call: OpCall, mdim: int) -> list[Strategy]:
    """select/unbind drop `dim`, split keeps it; either way `dim` itself must be replicated. The copying
    and unsafe forms place alike."""
    x = call.ins[0]
    drops = call.op in DROPS
    dim = call.arg(1 if drops else 2, "dim", 0) % x.ndim
    return follow(call, mdim, kept(x.ndim, dim, drops))


# -- slice_backward / select_backward: a gradient placed into zeros of the input's shape --------------
@register_rule(aten.slice_backward.default, aten.select_backward.default)
def placed_back(call: OpCall, mdim: int) -> list[Strategy]:
    """Every dim but `dim` keeps the gradient's shard; the zeros are sized per rank."""
    out = call.outs[0]
    dim = call.arg(2, "dim") % out.ndim
    if call.op is aten.select_backward.default:
        dims = {k: k + (k >= dim) for k in range(call.ins[0].ndim)}
    else:
        dims = {k: k for k in range(out.ndim) if k != dim}
    return follow(call, mdim, dims, resized)


# -- diagonal: other dims keep their shards, and one diagonal dim where its pieces hold the output's ----
@register_rule(*DIAGONALS)
def diagonal(call: OpCall, mdim: int) -> list[Strategy]:
    return follow(call, mdim, _diagonal_dims(call, mdim), _diagonal_emit)


@register_rule(aten.diagonal_scatter.default)
def diagonal_scatter(call: OpCall, mdim: int) -> list[Strategy]:
    """`src` (the new diagonal) is sharded where the input's dims map to."""
    dims = _diagonal_dims(call, mdim)
    moved = [Strategy((Shard(k), Shard(o)), (Shard(k),), _diagonal_emit) for k, o in sorted(dims.items())]
    return moved + partials(call, mdim, emit=_diagonal_emit)


@register_rule(aten.diagonal_backward.default)
def diagonal_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """The gradient placed on the diagonal of zeros of the input's shape."""
    return follow(call, mdim, {o: k for k, o in _diagonal_dims(call, mdim).items()}, _diagonal_emit)


def _diagonal_args(call: OpCall) -> tuple[Spec, int, int, int]:
    """(the spec of the tensor holding the diagonal, offset, dim1, dim2), dims non-negative."""
    x, i = (call.outs[0], 2) if call.op is aten.diagonal_backward.default else (call.ins[0], len(call.ins))
    return x, call.arg(i, "offset", 0), call.arg(i + 1, "dim1", 0) % x.ndim, call.arg(i + 2, "dim2", 1) % x.ndim


def _diagonal_dims(call: OpCall, mdim: int) -> dict[int, int]:
    """Dim of the full tensor -> dim of the diagonal tensor (the diagonal comes last) that mdim may shard.
    Rows (dim1) [s, s+l) hold entries [s - max(-offset, 0), ...) of the diagonal, columns (dim2) alike with
    max(offset, 0): a shard of either where those are the diagonal's pieces. Every mesh dim considers the
    same one (dim1 unless only dim2 is sharded), so that pieces of rows never meet pieces of columns."""
    x, off, d1, d2 = _diagonal_args(call)
    rest = [k for k in range(x.ndim) if k not in (d1, d2)]
    dims = {k: o for o, k in enumerate(rest)}
    if call.op is aten.diagonal_backward.default or Shard(d1) in x.placements or Shard(d2) not in x.placements:
        d, shift = d1, max(-off, 0)
    else:
        d, shift = d2, max(off, 0)
    n = (call.outs[0] if call.op in DIAGONALS else call.ins[-1]).shape[-1]

    def holds(a: Range, b: Range) -> bool:
        image = _image(a, shift, 1, n)
        return image == b or image[1] == b[1] == 0
    if aligned(x, d, n, mdim, holds):
        dims[d] = len(rest)
    return dims


def _diagonal_emit(ctx: Emit) -> list[Local]:
    """The offset on this rank's piece, whose rows and columns count from its first ones (and for a
    gradient, zeros of this rank's shape)."""
    call, (_, off, d1, d2) = ctx.call, _diagonal_args(ctx.call)
    backward = call.op is aten.diagonal_backward.default
    at = (ctx.outs[0] if backward else ctx.ins[0]).bounds(ctx.coords)
    lead = (ctx.args[0], list(ctx.local_out_shape())) if backward else ctx.args[:len(call.ins)]
    return [Local(op_name(call.op), (*lead, off + at[d1][0] - at[d2][0], d1, d2), {}, ctx.out_ids)]


# -- unfold: the unfolded dim kept where every piece holds whole windows, starting at its first element
@register_rule(*UNFOLDS, aten.unfold_backward.default)
def unfold(call: OpCall, mdim: int) -> list[Strategy]:
    """Windows along a dim (a new last dim holds each), or their gradient summed back into zeros of the
    input's shape. Every other dim maps to itself; the windowed dim too where each rank's piece [s, s+l)
    starts the rank's windows (t*step = s) and holds them whole, as the windows' pieces are."""
    x, dim, size, step = _unfold_args(call)
    dims = {k: k for k in range(x.ndim) if k != dim}

    def whole(a: Range, b: Range) -> bool:
        (s, n), (t, k) = a, b
        return k == (max(n - size, -1) // step + 1 if n else 0) and (not k or s == t * step)
    if x.ndim and aligned(x, dim, (x.shape[dim] - size) // step + 1, mdim, whole):
        dims[dim] = dim
    return follow(call, mdim, dims, _unfold_emit)


def _unfold_args(call: OpCall) -> tuple[Spec, int, int, int]:
    """(the spec of the unfolded tensor, dim, size, step)."""
    backward = call.op is aten.unfold_backward.default
    x, i = (call.outs[0], 2) if backward else (call.ins[0], 1)
    dim = call.arg(i, "dim" if backward else "dimension") % max(x.ndim, 1)
    return x, dim, call.arg(i + 1, "size"), call.arg(i + 2, "step")


def _unfold_emit(ctx: Emit) -> list[Local]:
    """A piece shorter than a window holds none (torch refuses to unfold it): zeros of the local shape."""
    x, dim, size, _ = _unfold_args(ctx.call)
    backward = ctx.call.op is aten.unfold_backward.default
    if x.ndim and (ctx.outs[0] if backward else ctx.ins[0]).local_shape(ctx.coords)[dim] < size:
        return [Local("aten::new_zeros", (ctx.args[0], list(ctx.local_out_shape())), {}, ctx.out_ids)]
    return resized(ctx) if backward else ctx.default()


# -- prims.rev (flip, fliplr, flipud, rot90): the reversed dims whole ---------------------------------
@register_rule(prims.rev.default)
def rev(call: OpCall, mdim: int) -> list[Strategy]:
    """Reversed dims are replicated: a reversed shard would put rank k's piece on rank n-1-k, a
    permutation no collective here performs. Each rank flips its piece."""
    x = call.ins[0]
    flipped = {d % x.ndim for d in call.arg(1, "dims")} if x.ndim else set()
    return follow(call, mdim, {k: k for k in range(x.ndim) if k not in flipped})


# -- as_strided: the whole tensor ---------------------------------------------------------------------
@register_rule(*AS_STRIDED)
def as_strided(call: OpCall, mdim: int) -> list[Strategy]:
    """Only on whole tensors (replicated or Partial): sizes and strides address the global storage."""
    return [Strategy((R,), (R,), _strided(None))] + partials(call, mdim, emit=_strided(None))


@register_rule(*AS_STRIDED_SCATTERS)
def as_strided_scatter(call: OpCall, mdim: int) -> list[Strategy]:
    scatter = _strided("aten::as_strided_scatter")
    return [Strategy((R, R), (R,), scatter)] + partials(call, mdim, emit=scatter)


def _strided(name: str | None) -> Emitter:
    """The op (or kernel `name`) on a copy of the piece laid out as the global tensor: strides and
    storage offset address the storage of a tensor of the input's global shape and strides at offset
    0, as tracing on meta tensors read them, while a piece may be a view or laid out otherwise."""
    def emit(ctx: Emit) -> list[Local]:
        spec, x = ctx.ins[0], ctx.args[0]
        blank, base = ctx.tmp(), ctx.tmp()
        return [Local("aten::new_empty_strided", (x, list(spec.shape), list(spec.stride)), {}, (blank.id,)),
                Local("aten::copy_", (blank, x), {}, (base.id,)),
                Local(name or op_name(ctx.call.op), (base, *ctx.args[1:]), ctx.kwargs, ctx.out_ids)]
    return emit
