"""Devices of MeshTensors: the device type an op's results are on, the check that its inputs agree, and the
moves between the host and the GPU (`t.to(device)`, `t.cpu()`, `t.cuda()`).

A MeshTensor's pieces live on the workers, on the CPU or on each worker's own GPU (`Spec.device`); the
controller-side wrapper is a CPU tensor to torch's C++ code (so autograd runs on a controller without CUDA),
and `MeshTensor.device` reports the pieces' device. An op's results are on the device it names (`device=`
of a factory or of `_to_copy`), else on its inputs' one; inputs on different devices raise DeviceError here,
as torch raises on the workers, except 0-dim CPU tensors beside GPU ones (scalars, which torch allows).
A move is an autograd Function whose backward moves the gradient back, since the C++ shortcut of
`Tensor.to` compares the wrapper's CPU device and would skip a GPU-to-host move altogether.
A meta MeshTensor (placed from a tensor built under `torch.device("meta")`) has a spec and a `MetaHandle`:
no buffer anywhere; `module.to_empty(device=...)` makes each rank's piece on its worker.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from monarch.errors import DeviceError
from monarch.tensor.spec import Spec

TYPES = ("cpu", "cuda")
CROSSING = frozenset(("aten::copy_", "aten::copy"))  # ops whose inputs may be on different devices


def device_type(device: torch.device | str | int, what: str, mesh_device: str) -> str:
    """The device type `device` names (an int is a CUDA index, as torch reads it), checked against the mesh."""
    kind = "cuda" if isinstance(device, int) else torch.device(device).type
    if kind not in TYPES:
        raise DeviceError(f"{what}: device {str(device)!r}: a MeshTensor's pieces live on 'cpu' or 'cuda' (its "
                          f"mesh's GPUs), not on {kind!r}")
    if kind == "cuda" and mesh_device != "cuda":
        raise DeviceError(f"{what}: device {str(device)!r}, but the mesh's workers have no GPU of their own (its "
                          f"device is {mesh_device!r}); spawn the mesh with spawn_procs(device='cuda') on hosts "
                          "with GPUs, or keep the tensor on 'cpu'")
    return kind


def result_device(what: str, args: Sequence[Any], kwargs: dict[str, Any], ins: Sequence[Spec], mesh_device: str) -> str:
    """The device type of an op's results: the one it names, else its inputs' (DeviceError if they differ); a
    copy into a tensor crosses devices, as in torch (`gpu_param.copy_(host_piece)`), and stays on its target's."""
    if what in CROSSING and ins:
        return ins[0].device
    named = kwargs.get("device")
    if named is None:
        named = next((a for a in args if isinstance(a, torch.device)), None)
    here = {s.device for s in ins if s.ndim or s.device != "cpu"}  # 0-dim CPU tensors go with any device
    if len(here) > 1:
        specs = ", ".join(repr(s) for s in ins)
        if "meta" in here:
            raise no_data(f"{what} of {specs}: inputs on the meta device and on {here - {'meta'}}")
        raise DeviceError(f"{what}: inputs on different devices ({specs}); move them to one with .to('cuda') or "
                          ".cpu() first, as plain torch requires")
    if named is not None:
        return device_type(named, what, mesh_device)
    if here:
        return here.pop()
    return ins[0].device if ins else mesh_device


def plain_device(t: torch.Tensor, mesh_device: str) -> str:
    """The device type of a plain tensor that becomes a constant of a mesh's program (sent from the controller)."""
    if t.device.type not in ("cpu", mesh_device):
        raise DeviceError(f"a plain {t.device.type} tensor of shape {tuple(t.shape)} met MeshTensors of a "
                          f"{mesh_device} mesh; pass it on the CPU (.cpu()) or distribute it")
    return t.device.type


def without_index(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's keywords as a worker runs them: "cuda" is each worker's own GPU, where an index would name the same
    one on every rank."""
    if kwargs.get("device") is None:
        return kwargs
    return {**kwargs, "device": torch.device(torch.device(kwargs["device"]).type)}


def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`Tensor.to` of a MeshTensor: a move to another device type through `_Move`; the rest (a dtype, the same
    device) as plain torch does it."""
    if args and isinstance(args[0], torch.Tensor):  # to(other): its device (a MeshTensor's tells the truth)
        device, dtype = args[0].device, args[0].dtype
    else:
        named = [a for a in args[:1] if isinstance(a, (str, torch.device)) or type(a) is int]  # to(device, ...)
        device = kwargs.get("device", named[0] if named else None)
        dtype = kwargs.get("dtype", _dtype_arg(args))
    return move(t, device, dtype, bool(kwargs.get("copy")), "Tensor.to")


def cpu(t: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> Any:
    return move(t, "cpu", None, False, "Tensor.cpu")


def cuda(t: torch.Tensor, device: torch.device | str | int | None = None, non_blocking: bool = False,
         memory_format: torch.memory_format = torch.preserve_format) -> Any:
    return move(t, "cuda" if device is None else device, None, False, "Tensor.cuda")


def move(t: torch.Tensor, device: torch.device | str | int | None, dtype: torch.dtype | None, copy: bool,
         what: str) -> Any:
    """`t` on `device` (its type) and `dtype`: a recorded `_to_copy` when the device type changes; otherwise
    NotImplemented, so plain torch runs the rest (a dtype change, a copy)."""
    spec: Spec = t._spec  # type: ignore[attr-defined]
    if device is None:
        return NotImplemented
    kind = device_type(device, what, t.mesh.device)  # type: ignore[attr-defined]
    if kind == spec.device:
        return NotImplemented
    out = _Move.apply(t, kind)
    return out if dtype is None or dtype == out.dtype else out.to(dtype, copy=copy)


def made_then_moved(func: Any, args: tuple, kwargs: dict, run: Callable[[Any, tuple, dict], Any]) -> Any:
    """`func(..., device=<a GPU>)` of a MeshTensor (`zeros_like(x, device="cuda")`): torch would initialise
    CUDA on the controller before dispatching, so the result is made on the CPU and moved (`run` runs a
    torch function the MeshTensor way)."""
    out = run(func, args, {**kwargs, "device": torch.device("cpu")})
    if not hasattr(out, "_spec"):
        return out
    return move(out, kwargs["device"], None, False, getattr(func, "__name__", str(func)))


def gpu_named(kwargs: dict) -> bool:
    """Whether a torch function's keywords name a GPU."""
    d = kwargs.get("device")
    return d is not None and (isinstance(d, int) or torch.device(d).type == "cuda")


def empty_like(t: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch.empty_like` of a MeshTensor. Of a meta one (what `module.to_empty(device=...)` calls) the pieces are
    made on the device named, None meaning the mesh's (the one place they can live); on a GPU, made there
    directly (torch's own empty_like would initialise CUDA on the controller first). Of others: as any torch
    function (NotImplemented), made on the CPU and moved when a GPU is named."""
    if isinstance(getattr(t, "_handle", None), MetaHandle):
        device, grad = kwargs.pop("device", None), kwargs.pop("requires_grad", False)
        kind = t.mesh.device if device is None else device_type(device, "empty_like (module.to_empty)", t.mesh.device)
        return torch.ops.aten.empty_like.default(t, *args, **kwargs, device=torch.device(kind)).requires_grad_(grad)
    if gpu_named(kwargs):
        return made_then_moved(torch.empty_like, (t, *args), kwargs, _call)
    return NotImplemented


def _call(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


def no_data(what: str) -> DeviceError:
    """The error of reading a meta MeshTensor's data (its buffer, its values), naming the fix."""
    return DeviceError(f"{what}: a meta MeshTensor (placed from a tensor built under torch.device('meta')) has a "
                       "shape and placements but no data, on the controller or on any worker; materialise the module "
                       "first: module.to_empty(device='cpu', 'cuda' or None for the mesh's device) makes each rank's "
                       "piece on its worker, then module.reset_parameters() (or nn.init.*, or load_state_dict) "
                       "fills them")


class MetaOwner(Protocol):
    """The session of a meta MeshTensor: it counts the live ones (while none lives, ops skip the meta check)."""
    metas: int


class MetaHandle:
    """The handle of a meta MeshTensor: a shape and placements (its spec, device "meta"), no buffer on the
    controller or on any worker. Whatever asks for its buffer (a fetch, a redistribution on the workers,
    a compiled step) gets `no_data`."""
    __slots__ = ("owner", "spec")
    copied_view = False  # no view of it shares storage: there is none

    def __init__(self, owner: MetaOwner, spec: Spec) -> None:
        owner.metas += 1
        self.owner, self.spec = owner, spec

    def __del__(self) -> None:
        self.owner.metas -= 1

    def aliased(self) -> bool:
        return False

    @property
    def id(self) -> int:
        raise no_data(f"reading the data of {self.spec!r}")

    node = id


def _dtype_arg(args: Sequence[Any]) -> torch.dtype | None:
    return next((a for a in args if isinstance(a, torch.dtype)), None)


class _Move(torch.autograd.Function):
    """A MeshTensor's pieces copied to another device type; the gradient goes back to the first one."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, kind: str) -> Any:
        ctx.source = t._spec.device  # type: ignore[attr-defined]
        return torch.ops.aten._to_copy.default(t, device=torch.device(kind))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return _Move.apply(grad, ctx.source), None
