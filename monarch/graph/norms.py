"""Norms as reductions: batch norm forward and backward as means and sums over the batch dims, group norm
within each sample's groups, _foreach_norm as one stacked reduction over all its tensors.

Over a sharded batch each sum is Partial, so the statistics (C values) are all_reduced, never the
activations. The statistics are computed in two passes like torch's kernel (the mean, then the mean of
squared deviations); running stats are updated in place with the unbiased variance, as torch does.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Replicate

aten = torch.ops.aten
Tensor = torch.Tensor


def _dims(x: Tensor) -> list[int]:
    """The dims batch norm reduces: all but the channel dim 1."""
    return [0, *range(2, x.ndim)]


def _channel(t: Tensor, x: Tensor) -> Tensor:
    """A (C,) tensor shaped to broadcast against x's channel dim."""
    return t.reshape([1, -1] + [1] * (x.ndim - 2))


def _compute(x: Tensor) -> Tensor:
    """Statistics in float32 for half-precision inputs (torch's accumulation type)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _whole(t: Tensor) -> Tensor:
    """`t` replicated: a Partial statistic summed over the mesh now (one all_reduce of C values), so that
    the ops using it keep the activations where they are."""
    if isinstance(t, MeshTensor) and any(p.is_partial() for p in t.placements):
        return t.redistribute([Replicate()] * len(t.placements))
    return t


def _normalize(x: Tensor, dev: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """(x - mean) * invstd * weight + bias, from the deviations dev = x - mean."""
    out = dev * _channel(invstd, x)
    if weight is not None:
        out = out * _channel(weight, x)
    if bias is not None:
        out = out + _channel(bias, x)
    return out.to(x.dtype)


def _batch_stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mean, biased var, 1/sqrt(var + eps)), each of shape (C,), and the deviations x - mean."""
    xc = _compute(x)
    mean = _whole(torch.mean(xc, _dims(x)))
    dev = xc - _channel(mean, x)
    var = _whole(torch.mean(dev * dev, _dims(x)))
    return mean, var, torch.rsqrt(var + eps), dev


def _update(running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor, var: Tensor, x: Tensor,
            momentum: float) -> None:
    n = x.numel() // x.shape[1]
    if running_mean is not None:
        running_mean.copy_(running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum)
    if running_var is not None:
        unbiased = var * (n / max(n - 1, 1))
        running_var.copy_(running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum)


def _empty_stat(x: Tensor) -> Tensor:
    return x.new_zeros((0,), dtype=_compute(x).dtype)


def native_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                      running_var: Tensor | None, training: bool, momentum: float, eps: float
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """native_batch_norm and _native_batch_norm_legit: (out, save_mean, save_invstd); eval mode saves nothing."""
    if not training:
        assert running_mean is not None and running_var is not None, "batch norm in eval mode needs running stats"
        invstd = torch.rsqrt(_compute(running_var) + eps)
        dev = _compute(x) - _channel(_compute(running_mean), x)
        return _normalize(x, dev, invstd, weight, bias), _empty_stat(x), _empty_stat(x)
    mean, var, invstd, dev = _batch_stats(x, eps)
    _update(running_mean, running_var, mean, var, x, momentum)
    return _normalize(x, dev, invstd, weight, bias), mean, invstd


def legit_no_stats(x: Tensor, weight: Tensor | None, bias: Tensor | None, training: bool, momentum: float,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return native_batch_norm(x, weight, bias, None, None, training, momentum, eps)


def legit_no_training(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor,
                      running_var: Tensor, momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)


def with_update(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor, running_var: Tensor,
                momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """_batch_norm_with_update: training mode, plus an empty reserve tensor."""
    out = native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
    return (*out, x.new_zeros((0,), dtype=torch.uint8))


def native_batch_norm_backward(grad: Tensor, x: Tensor, weight: Tensor | None, running_mean: Tensor | None,
                               running_var: Tensor | None, save_mean: Tensor | None, save_invstd: Tensor | None,
                               train: bool, eps: float, output_mask: list[bool]) -> tuple[Tensor | None, ...]:
    """d input = invstd * w * (g - mean(g) - xhat * mean(g * xhat)) in training (the batch stats depend on
    the input), invstd * w * g in eval; d weight = sum(g * xhat), d bias = sum(g), over the batch dims."""
    if train:
        assert save_mean is not None and save_invstd is not None, "training backward needs the saved stats"
        mean, invstd = save_mean, save_invstd
    else:
        assert running_mean is not None and running_var is not None, "eval backward needs the running stats"
        mean, invstd = _compute(running_mean), torch.rsqrt(_compute(running_var) + eps)
    g, dims, n = _compute(grad), _dims(x), x.numel() // x.shape[1]
    xhat = (_compute(x) - _channel(mean, x)) * _channel(invstd, x)
    sum_g, sum_gx = torch.sum(g, dims), torch.sum(g * xhat, dims)  # Partial over a sharded batch
    grad_input = None
    if output_mask[0]:
        if train:
            g = g - _channel(_whole(sum_g) / n, x) - xhat * _channel(_whole(sum_gx) / n, x)
        scale = invstd if weight is None else invstd * _compute(weight)
        grad_input = (g * _channel(scale, x)).to(x.dtype)
    dtype = x.dtype if weight is None else weight.dtype
    return grad_input, sum_gx.to(dtype) if output_mask[1] else None, sum_g.to(dtype) if output_mask[2] else None


def batch_norm_backward(grad: Tensor, x: Tensor, weight: Tensor | None, running_mean: Tensor | None,
                        running_var: Tensor | None, save_mean: Tensor | None, save_var: Tensor | None,
                        update: bool, eps: float, output_mask: list[bool], reserve: Tensor
                        ) -> tuple[Tensor | None, ...]:
    """batch_norm_backward (the pair of _batch_norm_with_update): save_var holds 1/sqrt(var + eps) there too."""
    return native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps,
                                      output_mask)


def native_group_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, n: int, c: int, hxw: int, group: int,
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Statistics per (sample, group): a batch shard needs no collective. (out, mean, rstd), the last two (N, G)."""
    xg = _compute(x).reshape(n, group, -1)
    mean = torch.mean(xg, [2])
    dev = xg - mean.unsqueeze(2)
    rstd = torch.rsqrt(torch.mean(dev * dev, [2]) + eps)
    out = (dev * rstd.unsqueeze(2)).reshape(x.shape)
    if weight is not None:
        out = out * _channel(_compute(weight), x)
    if bias is not None:
        out = out + _channel(_compute(bias), x)
    return out.to(x.dtype), mean, rstd


def native_group_norm_backward(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor | None, n: int,
                               c: int, hxw: int, group: int, output_mask: list[bool]) -> tuple[Tensor | None, ...]:
    """d input = rstd * (g - mean(g) - xhat * mean(g * xhat)) per group, with g = grad * weight; d weight and
    d bias sum over the samples and positions (Partial over a sharded batch)."""
    g = _compute(grad)
    xhat = ((_compute(x).reshape(n, group, -1) - mean.unsqueeze(2)) * rstd.unsqueeze(2)).reshape(x.shape)
    grad_input = None
    if output_mask[0]:
        gw = (g if weight is None else g * _channel(_compute(weight), x)).reshape(n, group, -1)
        xg = xhat.reshape(n, group, -1)
        gi = gw - torch.mean(gw, [2], keepdim=True) - xg * torch.mean(gw * xg, [2], keepdim=True)
        grad_input = (gi * rstd.unsqueeze(2)).reshape(x.shape).to(x.dtype)
    dtype = x.dtype if weight is None else weight.dtype
    grad_weight = torch.sum(g * xhat, _dims(x)).to(dtype) if output_mask[1] else None
    grad_bias = torch.sum(g, _dims(x)).to(dtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def foreach_norm(tensors: list[Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[Tensor]:
    """_foreach_norm (clip_grad_norm_'s, foreach=True): each tensor's local sum of |x|^p (max for inf), stacked
    and combined once (one all_reduce per mesh dim for all the tensors together), then the p-th roots."""
    p = float(ord)
    if p not in (1.0, 2.0, math.inf) or not tensors or any(t.numel() == 0 for t in tensors):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]
    xs = [_compute(t if dtype is None else t.to(dtype)).abs() for t in tensors]
    parts = [torch.amax(x) if p == math.inf else torch.sum(x * x if p == 2 else x) for x in xs]
    total = _whole(torch.stack(parts))
    roots = torch.sqrt(total) if p == 2 else total
    return [r.to(t.dtype if dtype is None else dtype) for r, t in zip(roots.unbind(0), tensors, strict=True)]


NORMS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.native_batch_norm.default: native_batch_norm,
    aten._native_batch_norm_legit.default: native_batch_norm,
    aten._native_batch_norm_legit.no_stats: legit_no_stats,
    aten._native_batch_norm_legit_no_training.default: legit_no_training,
    aten._batch_norm_with_update.default: with_update,
    aten.native_batch_norm_backward.default: native_batch_norm_backward,
    aten.batch_norm_backward.default: batch_norm_backward,
    aten.native_group_norm.default: native_group_norm,
    aten.native_group_norm_backward.default: native_group_norm_backward,
    aten._foreach_norm.Scalar: foreach_norm,
}
