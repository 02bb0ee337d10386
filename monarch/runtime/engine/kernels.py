"""The `monarch::` kernels: local helpers that per-rank programs call besides aten ops.

Each takes local tensors and plain values and returns a new tensor (never a view of an input, so an
in-place op on the result cannot reach a buffer another MeshTensor holds).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from monarch.errors import ShardingError, TransportError
from monarch.runtime.engine import crossmesh


def chunk(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """This rank's piece of a replicated tensor."""
    return x.narrow(dim, start, length).clone()


def partialize(x: torch.Tensor, keep: bool, op: str = "sum") -> torch.Tensor:
    """A replicated tensor as Partial(op): the first rank of the dim keeps it, the others hold zeros (sum),
    ones (prod), or keep it too (avg, max and min, whose reduction of equal values is that value)."""
    if keep or op in ("max", "min", "avg"):
        return x.clone()
    return torch.ones_like(x) if op == "prod" else torch.zeros_like(x)


def constant(x: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """Data shipped by the controller (a distributed tensor's piece), on the device it is for."""
    return x if device == "cpu" else x.to(device)


def random(kind: str, shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...],
           seed: int | tuple[int, torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    """The piece `bounds` of a global random tensor that depends only on `seed` (not on the placement);
    in a compiled program the seed is (seed, this call's salt)."""
    if isinstance(seed, tuple):
        seed = (seed[0] * 1_000_003 + int(seed[1])) % (1 << 63)
    gen = torch.Generator().manual_seed(seed)
    kw = dict(kwargs)
    device = kw.pop("device", "cpu")  # drawn on the host: the same numbers on every device
    full = RANDOM[kind](shape, gen, **kw)
    for d, (start, n) in enumerate(bounds):
        if (start, n) != (0, shape[d]):
            full = full.narrow(d, start, n)
    return full.contiguous().to(device)


RANDOM: dict[str, Callable[..., torch.Tensor]] = {
    "randn": lambda shape, gen, dtype: torch.randn(shape, generator=gen, dtype=dtype),
    "rand": lambda shape, gen, dtype: torch.rand(shape, generator=gen, dtype=dtype),
    "randint": lambda shape, gen, low, high, dtype: torch.randint(low, high, shape, generator=gen, dtype=dtype),
}


def arange(start: float, step: float, first: int, length: int, dtype: torch.dtype, device: str = "cpu"
           ) -> torch.Tensor:
    """Elements first..first+length of arange(start, ..., step)."""
    return torch.arange(length, dtype=torch.float64 if dtype.is_floating_point else torch.int64).mul_(step).add_(
        start + first * step).to(dtype=dtype, device=device)


_LOCAL_FNS: dict[bytes, Callable[..., Any]] = {}


Planned = tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (local shape, dtype) of each output


class Tape:
    """What a local_map call that needs gradients keeps for its backward: the inputs that need one and
    fn's results, with the autograd graph between them."""
    __slots__ = ("ins", "outs")

    def __init__(self, ins: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...]) -> None:
        self.ins, self.outs = ins, outs


def local_map(fn: bytes, name: str, planned: Planned, needs: tuple[int, ...], *args: Any) -> Any:
    """Run a user function (pickled by the controller) on this rank's pieces; its results must have the
    local shapes and dtypes that tracing it on meta tensors planned (ShardingError otherwise). With
    `needs` (the arguments that need a gradient), the results are followed by their Tape."""
    f = _LOCAL_FNS.get(fn)
    if f is None:
        from monarch.runtime.control import codec
        f = _LOCAL_FNS[fn] = codec.loads(fn)
    if needs:
        args = tuple(a.detach().requires_grad_() if i in needs else a for i, a in enumerate(args))
    with torch.enable_grad() if needs else contextlib.nullcontext():
        out = f(*args)
    multi = isinstance(out, (tuple, list))
    outs = list(out) if multi else [out]
    if len(outs) != len(planned):
        raise ShardingError(f"local_map({name}) returned {len(outs)} results here, but tracing it on meta tensors "
                            f"gave {len(planned)}; fn must return the same structure on real and on meta tensors")
    for k, (o, (shape, dtype)) in enumerate(zip(outs, planned, strict=True)):
        _check_planned(name, k, o, shape, dtype)
    if needs:
        return (*(o.detach().contiguous() for o in outs), Tape(tuple(args[i] for i in needs), tuple(outs)))
    return tuple(o.contiguous() for o in outs) if multi else out.contiguous()


def local_map_backward(tape: Tape, *grads: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The gradients of a local_map call's inputs from its results' (None: none reached that result)."""
    pairs = [(o, g) for o, g in zip(tape.outs, grads, strict=True) if g is not None and o.requires_grad]
    got: Sequence[torch.Tensor | None] = [None] * len(tape.ins)
    if pairs:  # the graph stays for another backward until the controller frees the tape, as in torch
        got = torch.autograd.grad([o for o, _ in pairs], tape.ins, [g for _, g in pairs], retain_graph=True,
                                  allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g.contiguous() for x, g in zip(tape.ins, got, strict=True))


def _check_planned(name: str, k: int, o: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None
    if got != (shape, dtype):
        have = f"{type(o).__name__} {o!r:.60}" if got is None else f"shape {got[0]} {got[1]}"
        raise ShardingError(f"local_map({name}): result {k} has {have} here, but tracing fn on meta tensors planned "
                            f"shape {shape} {dtype} for this rank; fn must give real tensors the shapes and dtypes "
                            "it gives meta ones (do not branch on x.is_meta or on the values)")


def linear_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """monarch::linear's weight gradient, "...n,...k->nk" (its definition lives on the controller's side)."""
    lead = list(range(x.ndim - 1))
    return torch.tensordot(grad, x, dims=(lead, lead))


def refused(message: str) -> torch.Tensor:
    """Stands for a value the controller did not send (over MONARCH_MAX_FRAME): using it raises why."""
    raise TransportError(message)


def _checkpoint(name: str) -> Callable[..., Any]:
    """A kernel of monarch.runtime.engine.checkpoint, which loads torch.distributed.checkpoint (about 1 s)
    when a checkpoint first needs it."""
    def run(*args: Any) -> Any:
        from monarch.runtime.engine import checkpoint
        return checkpoint.KERNELS[name](*args)
    return run


KERNELS: dict[str, Callable[..., Any]] = {
    "monarch::chunk": chunk, "monarch::partialize": partialize, "monarch::constant": constant,
    "monarch::random": random, "monarch::arange": arange,
    "monarch::local_map": local_map, "monarch::local_map_backward": local_map_backward,
    "monarch::matmul": torch.matmul, "monarch::refused": refused,
    "monarch::linear": torch.nn.functional.linear, "monarch::linear_weight_grad": linear_weight_grad,
    "monarch::rdma_export": crossmesh.export, "monarch::rdma_pull": crossmesh.pull,
    "monarch::stage_create": crossmesh.stage_create, "monarch::stage_out": crossmesh.stage_out,
    "monarch::stage_in": crossmesh.stage_in, "monarch::stage_drop": crossmesh.stage_drop,
    **{f"monarch::dcp_{name}": _checkpoint(name) for name in (
        "write", "wait", "finish", "abort", "metadata", "read", "rng_state", "set_rng_state")},
}
