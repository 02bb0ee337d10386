"""Ops monarch adds to torch so that a MeshTensor keeps them whole: `monarch::matmul`, `monarch::linear`.

`a @ b` on MeshTensors with batch dims would reach the rule table as expand, a view merging the batch
dims, bmm and a view back; merging a sharded inner batch dim (attention's heads) with its outer one
cannot keep the shard, so every attention matmul would move data. F.linear on a (seq, batch, features)
input merges seq with the batch the same way. Recorded as one op, each has an einsum rule in which
every batch dim may stay sharded. Under `torch.autocast` they cast their inputs as torch's own
matmul and linear do (both run in the lower precision), so a model autocasts the same on a mesh.
"""
from __future__ import annotations

from typing import Any

import torch

from monarch.tensor import attention, setitem
from monarch.tensor.device import cpu as to_cpu, cuda as to_cuda, empty_like, to as to_device


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


@torch.library.custom_op("monarch::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for an input of at least 3 dims: "...k,nk->...n" plus the bias."""
    return torch.nn.functional.linear(x, w, b)


@linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("monarch::linear_weight_grad", mutates_args=())
def linear_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The weight gradient of `linear`: "...n,...k->nk", a sum over every leading dim."""
    lead = list(range(x.ndim - 1))
    return torch.tensordot(grad, x, dims=(lead, lead))


@linear_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((grad.shape[-1], x.shape[-1]))


def _linear_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, w, b = inputs
    ctx.save_for_backward(x, w)  # type: ignore[attr-defined]
    ctx.has_bias = b is not None  # type: ignore[attr-defined]


def _linear_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    gx = linear(grad, w.t(), None) if need_x else None
    gw = linear_weight_grad(grad, x) if need_w else None
    gb = grad.sum(list(range(grad.ndim - 1))) if need_b and ctx.has_bias else None
    return gx, gw, gb


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _autocast_like_torch(op: torch._ops.OpOverload, device: str) -> None:
    """Under autocast on `device`, cast `op`'s floating inputs (float64 excepted, as torch does) to the
    autocast dtype of that moment, then run it with autocast off. torch.library's register_autocast
    fixes the dtype once; torch's matmul and linear follow `torch.autocast(dtype=...)`."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device))

    def kernel(keyset: Any, *args: Any) -> Any:
        dtype = torch.get_autocast_dtype(device)
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64
                and a.device.type == device else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast)
    _AUTOCAST.impl(op._schema.name.split("::")[1], kernel, key.name, with_keyset=True)


_AUTOCAST = torch.library.Library("monarch", "IMPL")  # noqa: TOR901 - kept for the process's lifetime
for _op in (torch.ops.monarch.matmul.default, torch.ops.monarch.linear.default):
    for _device in ("cpu", "cuda"):
        _autocast_like_torch(_op, _device)


def linear_call(input: Any, weight: Any, bias: Any = None) -> Any:
    """`F.linear` as `monarch::linear` for an input of 3 dims or more, else NotImplemented."""
    if (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor) and input.ndim >= 3 and weight.ndim == 2
            and (bias is None or isinstance(bias, torch.Tensor) and bias.ndim == 1)):
        return linear(input, weight, bias)
    return NotImplemented


def batched(a: object, b: object) -> bool:
    """Whether `a @ b` is a batched matmul that `monarch::matmul` keeps whole."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim >= 3 and a.ndim == b.ndim
            and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2])


READS_DATA = frozenset([torch.tensor_split, torch.Tensor.tensor_split])  # read an index tensor's values in C++
WHOLE: dict[Any, Any] = {  # composite ops that would merge a sharded batch dim with another dim, and moves
    torch.nn.functional.linear: linear_call,
    torch.Tensor.to: to_device, torch.Tensor.cpu: to_cpu, torch.Tensor.cuda: to_cuda,
    torch.empty_like: empty_like,  # a meta MeshTensor made on the workers (module.to_empty)
    torch.nn.functional.multi_head_attention_forward: attention.multi_head_attention_forward,
    torch.Tensor.__setitem__: setitem.assign,  # along a sharded dim
}
