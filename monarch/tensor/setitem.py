"""`x[index] = scalar` on a MeshTensor sharded along an indexed dim, as one masked write of the whole x.

torch records the assignment as views (select, slice) and a fill of the view; a select along a sharded
dim needs the dim replicated, and a write through a redistributed view would not reach x. When every
index item picks positions along its own dim (ints, one 1-D index tensor, full slices), the written
positions are the outer product of one mask per dim: `where` with those masks writes exactly them.
(Partial slices are left to torch's way: x[0:2] = v along a shard is refused, not rewritten.)
"""
from __future__ import annotations

from typing import Any

import torch

from monarch.tensor.placement import Shard


def assign(x: Any, index: Any, value: Any) -> Any:
    """`x[index] = value` as `x.copy_(where(mask_0, where(mask_1, ..., value, x), x))`, or NotImplemented
    where torch's own way works (no indexed dim is sharded) or the index is not one mask per dim."""
    masks = _masks(tuple(x.shape), index if isinstance(index, tuple) else (index,))
    if masks is None or not _scalar(value) or not _sharded(x, masks):
        return NotImplemented
    out = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=x.dtype, device="cpu")
    for d, m in reversed(masks.items()):
        out = torch.where(m.view([-1 if k == d else 1 for k in range(x.ndim)]), out, x)
    x.copy_(out)
    return None


def _scalar(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, torch.Tensor) and value.ndim == 0 and type(value) is torch.Tensor


def _sharded(x: Any, masks: dict[int, torch.Tensor]) -> bool:
    return any(isinstance(p, Shard) and p.dim in masks for p in x.placements)


def _masks(shape: tuple[int, ...], items: tuple[Any, ...]) -> dict[int, torch.Tensor] | None:
    """Dim -> bool mask of the positions the index picks there (full slices have none), or None."""
    if sum(i is Ellipsis for i in items) > 1 or any(i is None or isinstance(i, bool) for i in items):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1:]
    if len(items) > len(shape) or sum(isinstance(i, torch.Tensor) for i in items) > 1:
        return None
    masks = {}
    for d, item in enumerate(items):
        if isinstance(item, slice) and item == slice(None):
            continue
        m = _mask(shape[d], item)
        if m is None:
            return None
        masks[d] = m
    return masks


def _mask(n: int, item: Any) -> torch.Tensor | None:
    m = torch.zeros(n, dtype=torch.bool, device="cpu")  # a plain tensor, also inside procs.activate()
    if isinstance(item, int) and -n <= item < n:
        m[item] = True
    elif (type(item) is torch.Tensor and item.ndim == 1 and not item.is_floating_point()
          and item.dtype != torch.bool and bool(((item >= -n) & (item < n)).all())):
        m[item] = True
    else:
        return None
    return m
