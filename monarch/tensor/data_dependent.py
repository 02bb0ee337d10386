"""Ops whose output shape or result depends on the values (nonzero, masked_select, x[mask], unique,
bincount, repeat_interleave, histograms, equal, allclose), rewritten into ops of known shapes with
rules after reading the few numbers they need (a sync point, like item()): counts, bounds, one flag.
Histograms count on the ranks between edges computed here as torch computes them; the CTC loss given
length tensors runs as its list overload. Each rewrite returns what plain torch returns on the whole tensors.
"""
from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from typing import Any

import torch

from monarch.errors import ShapeError, TraceError
from monarch.tensor.placement import Replicate

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


Runs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _runs(first: torch.Tensor, what: str) -> Runs:
    """For flags `first` (1-d, True where a run of equal neighbours starts): the runs' starts, each
    element's run number and the runs' lengths."""
    n = _read(first.sum(), what)
    starts = aten.nonzero_static.default(first, size=n).select(1, 0)
    ends = torch.cat([starts[1:], starts.new_full((1,), first.shape[0])])
    return starts, first.cumsum(0) - 1, ends - starts


def _starts(differs: torch.Tensor) -> torch.Tensor:
    """Run-start flags from `differs` (element i + 1 differs from element i)."""
    return torch.cat([differs.new_ones((1,)), differs])


def _flat_runs(flat: torch.Tensor, inverse: bool, counts: bool, what: str,
               order: torch.Tensor | None = None) -> Runs:
    """Values, inverse and counts of the runs of equal neighbours in 1-d `flat` (sorted from the input by
    `order` when given); inverse and counts are empty (0,) tensors when not asked for, as in torch."""
    none = flat.new_zeros((0,), dtype=torch.long)
    if flat.shape[0] == 0:
        return flat.clone(), none, none.clone()
    starts, group, lengths = _runs(_starts(flat[1:] != flat[:-1]), what)
    inv = (group if order is None else group.index_select(0, order.argsort())) if inverse else none
    return flat.index_select(0, starts), inv, lengths if counts else none


def unique2(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False,
            return_counts: bool = False) -> Runs:
    """torch.unique without dim: always sorted (a valid order for sorted=False too)."""
    values, order = aten.sort.stable(x.reshape(-1), stable=True)
    out, inv, counts = _flat_runs(values, return_inverse, return_counts, "unique", order)
    return out, inv.reshape(x.shape) if return_inverse else inv, counts


def unique(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out, inv, _ = unique2(x, sorted, return_inverse, False)
    return out, inv


def unique_consecutive(x: torch.Tensor, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None) -> Runs:
    if dim is not None:
        return _slice_runs(x, dim, None, return_inverse, return_counts, "unique_consecutive")
    out, inv, counts = _flat_runs(x.reshape(-1), return_inverse, return_counts, "unique_consecutive")
    return out, inv.reshape(x.shape) if return_inverse else inv, counts


def unique_dim(x: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False,
               return_counts: bool = False) -> Runs:
    """Slices along `dim` in lexicographic order (a stable sort by each element, the last first), then
    the first of each run of equal slices."""
    dim = _slice_dim(x, dim, "unique")
    order = None
    if x.shape[dim]:
        rows = x.movedim(dim, 0).reshape(x.shape[dim], -1)
        order = torch.ones_like(rows[:, 0], dtype=torch.long).cumsum(0) - 1
        for j in reversed(range(rows.shape[1])):
            order = order.index_select(0, aten.sort.stable(rows[:, j].index_select(0, order), stable=True)[1])
    return _slice_runs(x, dim, order, return_inverse, return_counts, "unique")


def _slice_dim(x: torch.Tensor, dim: int, what: str) -> int:
    dim = dim % max(x.ndim, 1)
    if any(n == 0 for d, n in enumerate(x.shape) if d != dim):
        raise ShapeError(f"{what}: there are 0 sized dimensions, and they aren't selected, so unique cannot be "
                         "applied")
    return dim


def _slice_runs(x: torch.Tensor, dim: int, order: torch.Tensor | None, inverse: bool, counts: bool,
                what: str) -> Runs:
    """unique_consecutive over the slices along `dim` (taken in `order` when given)."""
    dim = _slice_dim(x, dim, what)
    n = x.shape[dim]
    none = x.new_zeros((0,), dtype=torch.long)
    if n == 0:
        return x.clone(), none, none.clone()
    taken = x if order is None else x.index_select(dim, order)
    differs = taken.narrow(dim, 1, n - 1) != taken.narrow(dim, 0, n - 1)
    others = [d for d in range(x.ndim) if d != dim]
    if others:
        differs = differs.any(others)
    starts, group, lengths = _runs(_starts(differs), what)
    keep = starts if order is None else order.index_select(0, starts)
    inv = (group if order is None else group.index_select(0, order.argsort())) if inverse else none
    return x.index_select(dim, keep), inv, lengths if counts else none


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
    probe = None if weights is None else torch.zeros(1, dtype=weights.dtype, device="cpu")
    dtype = torch.bincount(torch.zeros(1, dtype=torch.long, device="cpu"), probe).dtype
    src = x.new_ones(x.shape, dtype=dtype) if weights is None else weights.to(dtype)
    return x.new_zeros((size,), dtype=dtype).index_add(0, x.long(), src)


def repeat_interleave(repeats: torch.Tensor, output_size: int | None = None) -> torch.Tensor:
    """Index i repeated repeats[i] times: for each output position, how many cumulative repeats are at
    or below it (a search in the cumulative sums)."""
    if repeats.ndim != 1 or repeats.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"repeat_interleave only accepts a 1-d int32 or int64 repeats tensor, got {repeats.dtype} "
                         f"of shape {list(repeats.shape)}")
    total = 0
    if repeats.shape[0]:
        total, low = _read(torch.stack([repeats.sum(), repeats.min()]), "repeat_interleave")
        if low < 0:
            raise ShapeError(f"repeat_interleave: repeats can not be negative, got {low}")
    if output_size is not None and output_size != total:
        raise ShapeError(f"repeat_interleave: output_size {output_size} does not match the sum of repeats {total}")
    ends = repeats.cumsum(0)
    at = repeats.new_ones((total,), dtype=torch.long).cumsum(0) - 1
    return torch.searchsorted(ends, at, right=True, out_int32=repeats.dtype == torch.int32)


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and every element equal: each rank compares its pieces, one flag is reduced."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    return not a.numel() or bool(_read(aten.eq.Tensor(a, b).all(), "equal"))


def allclose(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    if a.dtype != b.dtype:
        raise ShapeError(f"allclose: {a.dtype} did not match {b.dtype}")
    return bool(_read(torch.isclose(a, b, rtol, atol, equal_nan).all(), "allclose"))


# -- histograms: global bounds (one read), then counts on the ranks (a rule) --------------------------
def histogram(x: torch.Tensor, bins: int = 100, *, range: list[float] | None = None,
              weight: torch.Tensor | None = None, density: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    edges = _edges(_bounds(x, 1, range)[0], bins, x.dtype)
    hist, edges = aten.histogram.bins_tensor(x, edges, weight=weight)
    return (_density(hist, [edges]) if density else hist), edges


def histogram_bins(x: torch.Tensor, bins: torch.Tensor, *, weight: torch.Tensor | None = None,
                   density: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Counts are recorded as they are (the ranks count); density divides the summed counts."""
    if not density:
        return None
    hist, edges = aten.histogram.bins_tensor(x, bins, weight=weight)
    return _density(hist, [edges]), edges


def histogramdd_bin_edges(x: torch.Tensor, bins: list[int], *, range: list[float] | None = None,
                          weight: torch.Tensor | None = None, density: bool = False) -> list[torch.Tensor]:
    return [x.new_empty(e.shape, dtype=e.dtype).copy_(e) for e in _dd_edges(x, bins, range)]


def histogramdd_from_bin_cts(x: torch.Tensor, bins: list[int], *, range: list[float] | None = None,
                             weight: torch.Tensor | None = None, density: bool = False) -> torch.Tensor:
    return _dd_counts(x, _dd_edges(x, bins, range), weight, density)


def histogramdd_from_bin_tensors(x: torch.Tensor, bins: list[torch.Tensor], *, weight: torch.Tensor | None = None,
                                 density: bool = False) -> torch.Tensor | None:
    return _dd_counts(x, bins, weight, density) if density else None


def _dd_counts(x: torch.Tensor, edges: list[torch.Tensor], weight: torch.Tensor | None,
               density: bool) -> torch.Tensor:
    hist = aten._histogramdd_from_bin_tensors.default(x, edges, weight=weight)
    return _density(hist, edges) if density else hist


def _dd_edges(x: torch.Tensor, bins: list[int], range: list[float] | None) -> list[torch.Tensor]:
    if x.ndim < 2:
        raise ShapeError("histogramdd: the input should have at least 2 dimensions (points, coordinates)")
    n = x.shape[-1]
    if len(bins) != n:
        raise ShapeError(f"histogramdd: expected {n} bin counts (the size of the input's last dim), got {len(bins)}")
    return [_edges(b, k, x.dtype) for b, k in zip(_bounds(x, n, range), bins, strict=True)]


def _bounds(x: torch.Tensor, n: int, given: list[float] | None) -> list[tuple[float, float]]:
    """(min, max) of each of the n coordinates (n == 1: of every element): the given range, else the
    data's (read here: one small all_reduce), else (0, 1) for no data, as torch does."""
    if given is not None:
        if len(given) != 2 * n:
            raise ShapeError(f"histogram: expected {2 * n} range values (a min and a max per coordinate), got "
                             f"{len(given)}")
        return [(float(given[2 * k]), float(given[2 * k + 1])) for k in builtins.range(n)]
    if not x.numel():
        return [(0.0, 1.0)] * n
    if n == 1:
        lows, highs = x.amin(), x.amax()
    else:
        dims = list(builtins.range(x.ndim - 1))
        lows, highs = x.amin(dims), x.amax(dims)
    lo, hi = _read(torch.stack([lows, highs]).reshape(2, n), "histogram")
    return list(zip(lo, hi, strict=True))


def _edges(bounds: tuple[float, float], bins: int, dtype: torch.dtype) -> torch.Tensor:
    """torch's bin edges (so that a value on an edge lands in torch's bin): an empty range widened by
    0.5 on each side, then `bins` equal steps from its min to its max."""
    lo, hi = bounds
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ShapeError(f"histogram: range of [{lo}, {hi}] is not finite")
    if lo > hi:
        raise ShapeError(f"histogram: min should not exceed max, got min {lo} max {hi}")
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return torch.linspace(lo, hi, bins + 1, dtype=dtype, device="cpu")


def _density(hist: torch.Tensor, edges: list[torch.Tensor]) -> torch.Tensor:
    """Counts over their total, then over each bin's width along each coordinate (torch's order), on
    the summed counts (each rank divides the whole counts: the values are torch's, bit for bit)."""
    if hasattr(hist, "placements"):  # a MeshTensor
        hist = hist.redistribute([Replicate()] * len(hist.placements))
    hist = hist / hist.sum()
    for k, e in enumerate(edges):
        shape = [1] * hist.ndim
        shape[k] = e.shape[0] - 1
        hist = hist / e.diff().reshape(shape)
    return hist


@torch.library.register_fake("aten::histogram.bins_tensor")
def _histogram_shapes(x: torch.Tensor, bins: torch.Tensor, *, weight: torch.Tensor | None = None,
                      density: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Output shapes of the counting kernels (torch has no meta kernel for them): one count per bin."""
    return x.new_empty((max(bins.shape[0] - 1, 0),)), bins.new_empty(bins.shape)


@torch.library.register_fake("aten::_histogramdd_from_bin_tensors")
def _histogramdd_shapes(x: torch.Tensor, bins: list[torch.Tensor], *, weight: torch.Tensor | None = None,
                        density: bool = False) -> torch.Tensor:
    torch._check(x.ndim >= 2, lambda: "torch.histogramdd: input tensor should have at least 2 dimensions")
    return x.new_empty([max(b.shape[0] - 1, 0) for b in bins])


def whole(obj: Any) -> Any:
    """`obj` (nested tuples, lists, dicts) with every MeshTensor replaced by its full data."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor()
    if isinstance(obj, (tuple, list)):
        return type(obj)(whole(o) for o in obj)
    if isinstance(obj, dict):
        return {k: whole(v) for k, v in obj.items()}
    return obj


def lengths_read(op: Any, at: int) -> Rewrite:
    """`op` (a list overload) given the two length tensors at arguments `at`, `at + 1` read as lists
    (the `.Tensor` overloads of the CTC loss and its backward)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        lengths = [[int(n) for n in _read(t, op.name())] for t in args[at:at + 2]]
        return op(*args[:at], *lengths, *args[at + 2:], **kwargs)
    return run


REWRITES: dict[Any, Rewrite] = {
    aten.nonzero.default: nonzero, aten.masked_select.default: masked_select, aten.index.Tensor: index,
    aten._unique2.default: unique2, aten._unique.default: unique, aten.unique_dim.default: unique_dim,
    aten.unique_consecutive.default: unique_consecutive, aten.bincount.default: bincount,
    aten.repeat_interleave.Tensor: repeat_interleave, aten.equal.default: equal, aten.allclose.default: allclose,
    aten.histogram.bin_ct: histogram, aten.histogram.bins_tensor: histogram_bins,
    aten._histogramdd_bin_edges.default: histogramdd_bin_edges,
    aten._histogramdd_from_bin_cts.default: histogramdd_from_bin_cts,
    aten._histogramdd_from_bin_tensors.default: histogramdd_from_bin_tensors,
    aten._ctc_loss.Tensor: lengths_read(aten._ctc_loss.default, 2),
    aten._ctc_loss_backward.Tensor: lengths_read(aten._ctc_loss_backward.default, 3),
}


def rewrites(func: Any) -> bool:
    """Whether `func` is rewritten here into ops of known shapes (a sync point instead of a rule)."""
    return func in REWRITES


def rewrite(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, result) when `func` is one of these ops (and applies to these arguments), else (False, None)."""
    fn = REWRITES.get(func)
    if fn is None:
        return False, None
    out = fn(*args, **kwargs)
    return out is not None, out
