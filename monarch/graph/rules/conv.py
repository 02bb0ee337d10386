"""Rules for convolutions (any rank, strided, dilated, grouped, transposed) and their backward op, pooling
(max, average, adaptive, with their backward ops), upsampling (interpolate), pads and embedding_bag.

Dims a kernel does not mix stay sharded: the batch and channel dims of pools, upsamples and pads, any
unpadded dim of a pad. A convolution is a contraction over in-channels: sharding them gives a Partial
output, sharding the weight's out-channels gives a channel-sharded output, a batch shard gives parameter
gradients Partial. Where a rank's piece is empty (kernels refuse empty channels), every rank pads
its empty dims with a zero row and slices the outputs back.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from monarch.graph.rules.common import aten
from monarch.graph.rules.table import Emit, Emitter, OpCall, OpOverload, Strategy, op_name, register_rule
from monarch.program.instr import Buf, Local
from monarch.tensor.placement import P, Placement, R, Shard
from monarch.tensor.spec import Spec


def _ops(names: Iterable[str], overloads: tuple[str, ...] = ("default",)) -> list[OpOverload]:
    """The named aten overloads this torch build has, sorted by name."""
    found = (getattr(getattr(aten, n, None), o, None) for n in names for o in overloads)
    return sorted((op for op in found if op is not None), key=str)


def _spatial(op: OpOverload) -> int:
    """How many trailing spatial dims the op's kernel mixes (the `2` of max_pool2d)."""
    match = re.search(r"(\d)d", str(op))
    assert match is not None, f"{op} names no spatial rank"
    return int(match.group(1))


def _empty_dims(spec: Spec) -> list[int]:
    """The dims on which some rank holds an empty piece of a tensor that is not empty as a whole."""
    if not all(spec.shape):
        return []
    return [d for d in range(spec.ndim) if any(spec.local_shape(c)[d] == 0 for c in spec.mesh.coords())]


Kernel = Callable[[Emit, tuple[Any, ...], dict[str, Any], list[int]], list[Local]]


def run_op(ctx: Emit, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[int]) -> list[Local]:
    return [Local(op_name(ctx.call.op), args, kwargs, tuple(outs))]


def padding_empty(kernel: Kernel = run_op) -> Emitter:
    """`kernel` on the op's arguments; where some rank's piece is empty (kernels refuse empty channels),
    every rank pads its empty dims with one zero row and slices its outputs back to their local shapes.
    A zero row contributes nothing to a Partial output, so those need no slicing."""
    def emit(ctx: Emit) -> list[Local]:
        if not any(_empty_dims(s) for s in (*ctx.ins, *ctx.outs)):
            return kernel(ctx, ctx.args, ctx.kwargs, list(ctx.out_ids))
        instrs: list[Local] = []
        specs = iter(ctx.ins)
        args = tuple(_pad_arg(ctx, a, specs, instrs) for a in ctx.args)
        kwargs = {k: _pad_arg(ctx, v, specs, instrs) for k, v in ctx.kwargs.items()}
        outs, slices = [], []
        for spec, out in zip(ctx.outs, ctx.out_ids, strict=True):
            src = out if not _empty_dims(spec) else ctx.tmp().id
            outs.append(src)
            local = spec.local_shape(ctx.coords)
            for j, d in enumerate(dims := _empty_dims(spec)):
                dst = out if j == len(dims) - 1 else ctx.tmp().id
                slices.append(Local("aten::slice.Tensor", (Buf(src), d, 0, local[d]), {}, (dst,)))
                src = dst
        return instrs + kernel(ctx, args, kwargs, outs) + slices
    return emit


def _pad_arg(ctx: Emit, a: Any, specs: Iterator[Spec], instrs: list[Local]) -> Any:
    """Argument `a`, padded by one zero row on each of its dims where this rank's piece is empty."""
    if not isinstance(a, Buf):
        return a
    spec = next(specs)
    dims = _empty_dims(spec)
    if not dims:
        return a
    local = spec.local_shape(ctx.coords)
    amounts = [p for d in reversed(range(spec.ndim)) for p in (0, int(d in dims and local[d] == 0))]
    padded = ctx.tmp()
    instrs.append(Local("aten::constant_pad_nd", (a, amounts, 0), {}, (padded.id,)))
    return padded


def padded_shape(ctx: Emit, spec: Spec) -> list[int]:
    """This rank's local shape of `spec` with its empty dims grown to one row (as padding_empty pads)."""
    dims = _empty_dims(spec)
    return [n + int(d in dims and n == 0) for d, n in enumerate(spec.local_shape(ctx.coords))]


PADDED = padding_empty()


# -- convolution ------------------------------------------------------------------------------------
def _channel_dims(x: Spec, w: Spec, transposed: bool) -> tuple[int, int, int]:
    """The input's channel dim (1 when batched) and the weight's out- and in-channel dims."""
    c = x.ndim - w.ndim + 1
    return (c, 1, 0) if transposed else (c, 0, 1)


@register_rule(aten.convolution.default)
def convolution(call: OpCall, mdim: int) -> list[Strategy]:
    """Batch-sharded input, replicated weight: batch-sharded output. groups=1 also shards channels:
    weight out-channels (and bias) give a channel-sharded output, in-channels of both the input and the
    weight a Partial one (the bias added on one rank). Linear in the input and in the weight."""
    x, w = call.ins[:2]
    c, out_w, in_w = _channel_dims(x, w, call.arg(6, "transposed"))

    def s(ins: tuple[Placement, ...], bias: Placement, out: Placement) -> Strategy:
        return Strategy((*ins, bias)[:len(call.ins)], (out,), PADDED)
    strategies = [s((P, R), P, P), s((R, P), P, P)]
    if c == 1:
        strategies.append(s((Shard(0), R), R, Shard(0)))
    if call.arg(8, "groups") == 1:
        strategies += [s((R, Shard(out_w)), Shard(0), Shard(c)), s((Shard(c), Shard(in_w)), P, P)]
    return strategies


@register_rule(aten.convolution_backward.default)
def convolution_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """(grad_input, grad_weight, grad_bias) as output_mask asks: the batch shard gives Partial parameter
    gradients; out-channel shards a Partial grad_input; in-channel shards keep grad_bias whole. Linear in
    grad_output."""
    g, x, w = call.ins
    c, out_w, in_w = _channel_dims(x, w, call.arg(7, "transposed"))
    mask = call.arg(10, "output_mask")

    def s(ins: tuple[Placement, ...], outs: tuple[Placement, ...]) -> Strategy:
        return Strategy(ins, tuple(p for p, on in zip(outs, mask, strict=True) if on), CONV_BACKWARD)
    strategies = [s((R, R, R), (R, R, R)), s((P, R, R), (P, P, P))]  # R listed for its kernel
    if c == 1:
        strategies.append(s((Shard(0), Shard(0), R), (Shard(0), P, P)))
    if call.arg(9, "groups") == 1:
        strategies += [s((Shard(c), R, Shard(out_w)), (P, Shard(out_w), Shard(0))),
                       s((R, Shard(c), Shard(in_w)), (Shard(c), Shard(in_w), R))]
    return strategies


def conv_backward_kernel(ctx: Emit, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[int]) -> list[Local]:
    """convolution_backward with bias_sizes (args[3]) made this rank's count of grad_output channels; asked
    for grad_bias, it also computes grad_weight (into a temporary), as CPU kernels do unasked."""
    if args[3] is not None:
        g, c = ctx.ins[0], ctx.ins[1].ndim - ctx.ins[2].ndim + 1
        args = (*args[:3], [padded_shape(ctx, g)[c]], *args[4:])
    mask = list(args[10])
    if mask[2] and not mask[1]:
        k = int(mask[0])
        outs = [*outs[:k], ctx.tmp().id, *outs[k:]]
        args = (*args[:10], [mask[0], True, True])
    return run_op(ctx, args, kwargs, outs)


CONV_BACKWARD = padding_empty(conv_backward_kernel)


# -- pooling, upsampling ----------------------------------------------------------------------------
POOLS = _ops(["adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d", "max_pool2d",
              "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices"])
LINEAR_POOLS = _ops(["_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d", "avg_pool1d",
                     "avg_pool2d", "avg_pool3d", "max_unpool2d", "max_unpool3d"])  # unpools: linear given indices
FRACTIONAL_POOLS = _ops(["fractional_max_pool2d", "fractional_max_pool3d"])
POOL_BACKWARDS = _ops(["_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
                       "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "avg_pool2d_backward",
                       "avg_pool3d_backward", "fractional_max_pool2d_backward", "fractional_max_pool3d_backward",
                       "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"])
UPSAMPLES = ["_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_bicubic2d", "upsample_bilinear2d",
             "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
             "upsample_trilinear3d"]
UPSAMPLE_FORWARDS = _ops(UPSAMPLES, ("default", "vec"))
UPSAMPLE_BACKWARDS = _ops([f"{n}_backward" for n in UPSAMPLES])


def leading(call: OpCall, linear: bool, emit: Emitter = PADDED) -> list[Strategy]:
    """Every tensor input and output sharded alike on a dim before the spatial ones; a Partial first
    input passes through ops linear in it (the others replicated)."""
    n_in, n_out = len(call.ins), len(call.outs)
    ndim = call.ins[0].ndim - _spatial(call.op)
    strategies = [Strategy((Shard(d),) * n_in, (Shard(d),) * n_out, emit) for d in range(ndim)]
    if linear:
        strategies.append(Strategy((P, *(R,) * (n_in - 1)), (P,) * n_out, emit))
    return strategies


@register_rule(*POOLS)
def pool(call: OpCall, mdim: int) -> list[Strategy]:
    return leading(call, linear=False)


@register_rule(*FRACTIONAL_POOLS)
def fractional_pool(call: OpCall, mdim: int) -> list[Strategy]:
    """A batched input's batch and channel dims, with the (N, C, 2) random samples sharded alike."""
    x = call.ins[0]
    if x.ndim != _spatial(call.op) + 2:
        return []
    return [Strategy((Shard(d), Shard(d)), (Shard(d),) * 2, PADDED) for d in range(2)]


@register_rule(*LINEAR_POOLS, *POOL_BACKWARDS, *UPSAMPLE_FORWARDS)
def linear_pool(call: OpCall, mdim: int) -> list[Strategy]:
    """Average pools and upsamples are linear in their input; every pool's backward in grad_output."""
    return leading(call, linear=True)


@register_rule(*UPSAMPLE_BACKWARDS)
def upsample_backward(call: OpCall, mdim: int) -> list[Strategy]:
    return leading(call, linear=True, emit=padding_empty(local_input_size))


def local_input_size(ctx: Emit, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[int]) -> list[Local]:
    """The backward op with its input_size argument (args[2]) made this rank's grad_input shape."""
    return run_op(ctx, (*args[:2], padded_shape(ctx, ctx.outs[0]), *args[3:]), kwargs, outs)


# -- pads -------------------------------------------------------------------------------------------
PADS = _ops([f"{kind}_pad{k}d" for kind in ("reflection", "replication") for k in (1, 2, 3)])
PAD_BACKWARDS = _ops([f"{kind}_pad{k}d_backward" for kind in ("reflection", "replication") for k in (1, 2, 3)])


def unpadded(x: Spec, pad: list[int]) -> list[int]:
    """The dims of x that `pad` (pairs from the last dim backwards) leaves alone."""
    padded = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p}
    return [d for d in range(x.ndim) if d not in padded]


@register_rule(aten.constant_pad_nd.default)
def constant_pad(call: OpCall, mdim: int) -> list[Strategy]:
    """Any unpadded dim; a Partial input passes through a zero pad."""
    x = call.ins[0]
    strategies = [Strategy((Shard(d),), (Shard(d),)) for d in unpadded(x, list(call.arg(1, "pad")))]
    if call.arg(2, "value", 0) in (0, None):
        strategies.append(Strategy((P,), (P,)))
    return strategies


@register_rule(*PADS, *PAD_BACKWARDS)
def pad(call: OpCall, mdim: int) -> list[Strategy]:
    """Reflection and replication pads (and their backward ops, whose padding is args[2]): any unpadded
    dim; linear in the first input."""
    backward = call.op in PAD_BACKWARDS
    padding = list(call.arg(2 if backward else 1, "padding"))
    n_in = len(call.ins)
    dims = unpadded(call.ins[0], padding)
    strategies = [Strategy((Shard(d),) * n_in, (Shard(d),), PADDED) for d in dims]
    return strategies + [Strategy((P, *(R,) * (n_in - 1)), (P,), PADDED)]


# -- embedding_bag ----------------------------------------------------------------------------------
MAX_MODE = 2  # embedding_bag modes: 0 sum, 1 mean, 2 max


@register_rule(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(call: OpCall, mdim: int) -> list[Strategy]:
    """Weight sharded on the feature dim: output (and max mode's argmax per feature) sharded on it too,
    bag bookkeeping replicated. Sum and mean are linear in the weight: a Partial weight passes through."""
    mode, rest = call.arg(4, "mode", 0), (R,) * (len(call.ins) - 1)
    argmax = Shard(1) if mode == MAX_MODE else R
    strategies = [Strategy((Shard(1), *rest), (Shard(1), R, R, argmax), PADDED)]
    if mode != MAX_MODE:
        strategies.append(Strategy((P, *rest), (P, R, R, R)))
    return strategies


@register_rule(aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default)
def embedding_bag_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """grad, indices, [offsets,] offset2bag, bag_size, maximum_indices[, per_sample_weights]: feature-sharded
    grad (and max mode's argmax) give a feature-sharded weight grad; linear in grad. Sparse grads gather."""
    dense = call.op is aten._embedding_bag_dense_backward.default
    if not dense and call.arg(9, "sparse"):
        return []
    mid = (R,) * (3 if dense else 4)
    rest = (R,) * (len(call.ins) - len(mid) - 2)
    argmax = Shard(1) if call.arg(7 if dense else 8, "mode") == MAX_MODE else R
    return [Strategy((Shard(1), *mid, argmax, *rest), (Shard(1),), PADDED),
            Strategy((P, *mid, R, *rest), (P,))]


@register_rule(aten._embedding_bag_per_sample_weights_backward.default)
def per_sample_weights_backward(call: OpCall, mdim: int) -> list[Strategy]:
    """grad and weight (sum mode): a dot product over features, Partial when both are feature-sharded;
    linear in each of them."""
    rest = (R,) * (len(call.ins) - 2)
    return [Strategy((Shard(1), Shard(1), *rest), (P,), PADDED), Strategy((P, R, *rest), (P,)),
            Strategy((R, P, *rest), (P,))]
