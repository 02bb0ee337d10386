"""Ops monarch adds to torch so that a MeshTensor keeps them whole: `monarch::matmul`.

`a @ b` on MeshTensors with batch dims would reach the rule table as expand, a view merging the batch
dims, bmm and a view back; merging a sharded inner batch dim (attention's heads) with its outer one
cannot keep the shard, so every attention matmul would move data. Recorded as one op, the batched
matmul has an einsum rule in which every batch dim may stay sharded.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("monarch::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for operands with the same batch dims (no broadcasting), at least 3 dims each."""
    return torch.matmul(a, b)


@matmul.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = ctx.saved_tensors  # type: ignore[attr-defined]
    return matmul(grad, b.transpose(-2, -1)), matmul(a.transpose(-2, -1), grad)


matmul.register_autograd(_backward, setup_context=_setup)


def batched(a: object, b: object) -> bool:
    """Whether `a @ b` is a batched matmul that `monarch::matmul` keeps whole."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim >= 3 and a.ndim == b.ndim
            and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2])
