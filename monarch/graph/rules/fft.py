"""Rules for the FFT kernels every `torch.fft` function records (`_fft_r2c`, `_fft_c2r`, `_fft_c2c`), for
`_conj` (the lazy conjugate `hfft` takes first) and the views between complex and real pairs.

A transform mixes every element along its dims, so those dims are replicated and any other dim may stay
sharded; a rank whose piece is empty (the FFT kernels refuse one) makes an empty result. Transforms and
the conjugate and the views are linear (over the reals), so `Partial(sum)` passes through.
"""
from __future__ import annotations

from monarch.graph.rules.common import aten, partials
from monarch.graph.rules.table import Emit, OpCall, Strategy, register_rule
from monarch.program.instr import Local
from monarch.tensor.placement import Shard

TRANSFORMS = sorted([aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default], key=str)


@register_rule(*TRANSFORMS)
def transform(call: OpCall, mdim: int) -> list[Strategy]:
    """Shard any dim that is not transformed (the output keeps the input's dims; only sizes change)."""
    x = call.ins[0]
    mixed = {d % x.ndim for d in call.arg(1, "dim")}
    kept = [Strategy((Shard(d),), (Shard(d),), _empty_safe) for d in range(x.ndim) if d not in mixed]
    return kept + partials(call, mdim, emit=_empty_safe)


def _empty_safe(ctx: Emit) -> list[Local]:
    """The transform, or zeros of this rank's output shape where its piece is empty."""
    if all(ctx.ins[0].local_shape(ctx.coords)):
        return ctx.default()
    return [Local("aten::new_zeros", (ctx.args[0], list(ctx.local_out_shape())), {"dtype": ctx.outs[0].dtype},
                  ctx.out_ids)]


@register_rule(aten._conj.default)
def conj(call: OpCall, mdim: int) -> list[Strategy]:
    """Elementwise: every dim may be sharded."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim)] + partials(call, mdim)


@register_rule(aten.view_as_real.default)
def view_as_real(call: OpCall, mdim: int) -> list[Strategy]:
    """(..., ) complex -> (..., 2) real: the input's dims keep their numbers."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim)] + partials(call, mdim)


@register_rule(aten.view_as_complex.default)
def view_as_complex(call: OpCall, mdim: int) -> list[Strategy]:
    """(..., 2) real -> (..., ) complex: every dim but the pair's."""
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(call.ins[0].ndim - 1)] + partials(call, mdim)
