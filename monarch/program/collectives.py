"""What each collective computes, as plain functions over the pieces of every group member.

This is the meaning the transports must reproduce: the single-process reference runs these directly,
and the MPI transport moves the same bytes between processes. Uneven pieces follow torch.chunk.
"""
from __future__ import annotations

import functools

import torch

from monarch.tensor.placement import chunk


def reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    fn = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}[op]
    if parts[0].dtype == torch.bool and op in ("sum", "max"):
        fn = torch.logical_or
    elif parts[0].dtype == torch.bool:
        fn = torch.logical_and
    return functools.reduce(fn, parts[1:], parts[0].clone())  # type: ignore[call-overload]


def split(x: torch.Tensor, dim: int, k: int) -> list[torch.Tensor]:
    """k torch.chunk pieces of x along dim, with empty pieces where chunk would give fewer."""
    n = x.shape[dim]
    return [x.narrow(dim, *chunk(n, k, i)) for i in range(k)]


def all_gather(parts: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    full = torch.cat(parts, dim)
    return [full.clone() for _ in parts]


def all_reduce(parts: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    total = reduce(parts, op)
    return [total.clone() for _ in parts]


def reduce_scatter(parts: list[torch.Tensor], op: str, dim: int) -> list[torch.Tensor]:
    return [p.contiguous() for p in split(reduce(parts, op), dim, len(parts))]


def all_to_all(parts: list[torch.Tensor], split_dim: int, cat_dim: int) -> list[torch.Tensor]:
    pieces = [split(p, split_dim, len(parts)) for p in parts]
    return [torch.cat([pieces[src][dst] for src in range(len(parts))], cat_dim).contiguous()
            for dst in range(len(parts))]


RUN = {
    "all_gather": lambda parts, c: all_gather(parts, c.dim),
    "all_reduce": lambda parts, c: all_reduce(parts, c.op),
    "reduce_scatter": lambda parts, c: reduce_scatter(parts, c.op, c.dim),
    "all_to_all": lambda parts, c: all_to_all(parts, c.dim, c.cat_dim),
}
