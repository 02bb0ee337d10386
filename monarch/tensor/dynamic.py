"""Ops whose output shape depends on the values (nonzero, masked_select, x[mask], unique, bincount,
histogram): shapes are decided before anything runs, so each is rewritten into ops of known shapes
after reading the one size it needs (a scalar the ranks compute: a sync point, like item()).

nonzero becomes nonzero_static of the counted size; masked_select and boolean-mask indexing index with
its result; unique sorts and keeps the first of each run; bincount adds into zeros of the counted
length. What has no such form (histogram, unique over a dim) runs on the gathered data here and comes
back replicated. Each rewrite returns what plain torch returns on the whole tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from monarch.errors import ShapeError, TraceError

aten = torch.ops.aten
WHY = ("the output shape depends on the values, which a monarch.compile'd step does not have while it is "
       "recorded; compute it outside the step")
Rewrite = Callable[..., Any]


def _read(t: torch.Tensor, what: str) -> Any:
    """The values of a small tensor the ranks computed, here (a sync point)."""
    try:
        return t.tolist()
    except TraceError as e:
        raise TraceError(f"{what}: {WHY} ({e})") from None


def nonzero(x: torch.Tensor) -> torch.Tensor:
    n = _read(aten.ne.Scalar(x, 0).sum(), "nonzero")
    return aten.nonzero_static.default(x, size=n)


def masked_select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    flat = x.expand(shape).reshape(-1)
    return flat.index_select(0, nonzero(mask.expand(shape).reshape(-1)).select(1, 0))


def index(x: torch.Tensor, indices: list[torch.Tensor | None]) -> torch.Tensor | None:
    """x[..., mask, ...]: a k-dim boolean (or uint8) mask stands for the k integer indices of its nonzeros,
    as in plain torch. None when no index is a mask (or a 0-dim one): the op is recorded as it is."""
    if not any(_is_mask(t) and t.ndim for t in indices) or any(_is_mask(t) and not t.ndim for t in indices):
        return None
    longs: list[torch.Tensor | None] = []
    for t in indices:
        if t is None or not _is_mask(t):
            longs.append(t)
            continue
        at = len(longs)
        if tuple(t.shape) != tuple(x.shape[at:at + t.ndim]):
            raise ShapeError(f"index: the shape of the mask {list(t.shape)} at index {at} does not match the "
                             f"shape of the indexed tensor {list(x.shape)} at dims {at}..{at + t.ndim - 1}")
        nz = nonzero(t)
        longs.extend(nz.select(1, k) for k in range(t.ndim))
    return aten.index.Tensor(x, longs)


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _runs(flat: torch.Tensor, inverse: bool, counts: bool, what: str,
          order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values, inverse and counts of the runs of equal neighbours in 1-d `flat` (sorted from the input by
    `order` when given); inverse and counts are empty (0,) tensors when not asked for, as in torch."""
    n_all = flat.shape[0]
    none = flat.new_zeros((0,), dtype=torch.long)
    if n_all == 0:
        return flat.clone(), flat.new_zeros((0,), dtype=torch.long), none
    first = torch.cat([flat.new_ones((1,), dtype=torch.bool), flat[1:] != flat[:-1]])
    n = _read(first.sum(), what)
    starts = aten.nonzero_static.default(first, size=n).select(1, 0)
    group = first.cumsum(0) - 1
    inv = (group if order is None else group.index_select(0, order.argsort())) if inverse else none
    ends = torch.cat([starts[1:], starts.new_full((1,), n_all)])
    return flat.index_select(0, starts), inv, (ends - starts) if counts else none


def unique2(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False,
            return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.unique without dim: always sorted (a valid order for sorted=False too)."""
    values, order = aten.sort.stable(x.reshape(-1), stable=True)
    out, inv, counts = _runs(values, return_inverse, return_counts, "unique", order)
    return out, inv.reshape(x.shape) if return_inverse else inv, counts


def unique(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out, inv, _ = unique2(x, sorted, return_inverse, False)
    return out, inv


def unique_consecutive(x: torch.Tensor, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None) -> Any:
    if dim is not None:
        return gathered(aten.unique_consecutive.default, x, return_inverse, return_counts, dim)
    out, inv, counts = _runs(x.reshape(-1), return_inverse, return_counts, "unique_consecutive")
    return out, inv.reshape(x.shape) if return_inverse else inv, counts


def bincount(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """Weights (or ones) added into zeros of length max(x) + 1 (at least minlength)."""
    if x.ndim != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ShapeError(f"bincount only supports 1-d non-negative integral inputs, got {x.dtype} of shape "
                         f"{list(x.shape)}")
    if weights is not None and tuple(weights.shape) != tuple(x.shape):
        raise ShapeError(f"bincount: weights {list(weights.shape)} must have the shape of the input {list(x.shape)}")
    size = minlength
    if x.shape[0]:
        high, low = _read(torch.stack([x.max(), x.min()]), "bincount")
        if low < 0:
            raise ShapeError(f"bincount only supports 1-d non-negative integral inputs, got a value {low}")
        size = max(size, high + 1)
    probe = None if weights is None else torch.zeros(1, dtype=weights.dtype)
    dtype = torch.bincount(torch.zeros(1, dtype=torch.long), probe).dtype
    src = x.new_ones(x.shape, dtype=dtype) if weights is None else weights.to(dtype)
    return x.new_zeros((size,), dtype=dtype).index_add(0, x.long(), src)


def gathered(func: Any, *args: Any, **kwargs: Any) -> Any:
    """`func` run here on the whole tensors; its tensors come back replicated on the inputs' mesh."""
    like = next(a for a in (*args, *kwargs.values()) if hasattr(a, "full_tensor"))
    try:
        out = func(*whole(args), **whole(kwargs))
    except TraceError as e:
        raise TraceError(f"{func.name()}: {WHY} ({e})") from None

    def back(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return like.new_empty(o.shape, dtype=o.dtype).copy_(o)
        return type(o)(back(p) for p in o) if isinstance(o, (tuple, list)) else o
    return back(out)


def whole(obj: Any) -> Any:
    """`obj` (nested tuples, lists, dicts) with every MeshTensor replaced by its full data."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor()
    if isinstance(obj, (tuple, list)):
        return type(obj)(whole(o) for o in obj)
    if isinstance(obj, dict):
        return {k: whole(v) for k, v in obj.items()}
    return obj


def _gathered(func: Any) -> Rewrite:
    return lambda *args, **kwargs: gathered(func, *args, **kwargs)


REWRITES: dict[Any, Rewrite] = {
    aten.nonzero.default: nonzero, aten.masked_select.default: masked_select, aten.index.Tensor: index,
    aten._unique2.default: unique2, aten._unique.default: unique,
    aten.unique_consecutive.default: unique_consecutive, aten.bincount.default: bincount,
    **{op: _gathered(op) for op in (aten.unique_dim.default, aten.histogram.bin_ct, aten.histogram.bins_tensor)},
}


def rewrite(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, result) when `func` is one of these ops (and applies to these arguments), else (False, None)."""
    fn = REWRITES.get(func)
    if fn is None:
        return False, None
    out = fn(*args, **kwargs)
    return out is not None, out
