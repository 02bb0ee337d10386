"""The sharded-tensor API on the controller: distribute_tensor, factories, fetch, explain, activate.

Factories record one node whose per-rank instruction creates the rank's piece on the worker; random
factories draw the global tensor from a seed (so the values do not depend on the placement) and keep
the piece. `activate(procs)` makes plain `torch.randn(...)` and friends create MeshTensors.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from monarch.errors import ShardingError, TraceError
from monarch.graph.partition import FREE_BATCH, outline, partition
from monarch.graph.rules.common import random_piece
from monarch.graph.rules.table import Emit
from monarch.program.instr import Local
from monarch.runtime.control.client import register_tensor_api
from monarch.runtime.control.futures import Future
from monarch.runtime.engine import kernels
from monarch.runtime.session import boundary, torch_state
from monarch.runtime.session.session import Session, all_sessions, session_of
from monarch.shape import MeshLike
from monarch.tensor.device import device_type
from monarch.tensor.dynamo import eager_under_torch_compile
from monarch.tensor.meshtensor import MeshTensor, serve
from monarch.tensor.placement import Partial, Placement, Replicate, Shard, normalize
from monarch.tensor.random import next_seed
from monarch.tensor.spec import Spec, spec_of

PlacementsArg = Mapping[str, Placement] | Sequence[Placement] | None
Device = torch.device | str | int | None
M = TypeVar("M", bound=MeshLike)


def _factory(procs: MeshLike, shape: Sequence[int], dtype: torch.dtype | None, placements: PlacementsArg,
             make: Callable[[Emit, Spec], Local], what: str, seeded: bool = False, device: Device = None
             ) -> MeshTensor:
    """A new MeshTensor on `device` (default: the mesh's own, as DTensor's factories use its mesh's device)."""
    s = session_of(procs)
    shape = _dims(shape)
    dtype = dtype or torch.get_default_dtype()
    ps = normalize(placements, s.abstract.labels, len(shape), what)
    if any(isinstance(p, Partial) for p in ps):
        raise ShardingError(f"{what}: a new tensor cannot be Partial {ps}; create it Replicate and redistribute")
    kind = procs.device if device is None else device_type(device, f"monarch.{what}", procs.device)
    meta = torch.empty(shape, dtype=dtype, device="meta")
    spec = Spec(shape, tuple(meta.stride()), dtype, ps, s.abstract, kind)
    node, ids = s.tracer.node(FACTORIES[what], (), (spec,), lambda ctx: [make(ctx, spec)])
    if seeded:
        s.tracer.seeded(node)
    return s.tracer.wrap(spec, node, ids[0])


def _dims(shape: Sequence[Any]) -> tuple[int, ...]:
    """A factory's shape, given as sizes or as one tuple or list of them."""
    return tuple(int(n) for n in (shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape))


@eager_under_torch_compile
def full(*shape: Any, fill_value: float, mesh: MeshLike, placements: PlacementsArg = None,
         dtype: torch.dtype | None = None, device: Device = None) -> MeshTensor:
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    return _factory(mesh, shape, dtype, placements, lambda ctx, spec: Local(
        "aten::full", (list(spec.local_shape(ctx.coords)), fill_value),
        {"dtype": spec.dtype, **_on(spec)}, ctx.out_ids), "full", device=device)


def _on(spec: Spec) -> dict[str, torch.device]:
    """The device keyword of a worker-side factory: none for the CPU."""
    return {} if spec.device == "cpu" else {"device": torch.device(spec.device)}


def zeros(*shape: Any, mesh: MeshLike, placements: PlacementsArg = None,
          dtype: torch.dtype | None = None, device: Device = None) -> MeshTensor:
    return full(*shape, fill_value=0, mesh=mesh, placements=placements, dtype=dtype or torch.get_default_dtype(),
                device=device)


def ones(*shape: Any, mesh: MeshLike, placements: PlacementsArg = None,
         dtype: torch.dtype | None = None, device: Device = None) -> MeshTensor:
    return full(*shape, fill_value=1, mesh=mesh, placements=placements, dtype=dtype or torch.get_default_dtype(),
                device=device)


def empty(*shape: Any, mesh: MeshLike, placements: PlacementsArg = None,
          dtype: torch.dtype | None = None, device: Device = None) -> MeshTensor:
    """Like zeros (workers fill new buffers, so no uninitialised memory is ever read)."""
    return zeros(*shape, mesh=mesh, placements=placements, dtype=dtype, device=device)


def _random(kind: str, shape: Sequence[Any], mesh: MeshLike, placements: PlacementsArg, dtype: torch.dtype | None,
            generator: torch.Generator | None, device: Device, **kw: Any) -> MeshTensor:
    """Drawn from monarch.manual_seed's stream on the workers; or, given the user's `generator`, drawn
    with it here (the numbers and generator state plain torch gives) and distributed."""
    if generator is not None:
        _draws_here(mesh, f"monarch.{kind}(..., generator=)")
        data = kernels.RANDOM[kind](_dims(shape), generator, dtype=dtype or torch.get_default_dtype(), **kw)
        return _copy(data, mesh, placements, device)

    def make(ctx: Emit, spec: Spec) -> Local:
        return random_piece(ctx, kind, spec, {"dtype": spec.dtype, **kw}, ctx.out_ids[0])
    return _factory(mesh, shape, dtype, placements, make, kind, seeded=True, device=device)


def _draws_here(mesh: MeshLike, what: str) -> None:
    """A random tensor drawn on the controller cannot be part of a compiled step: the step would replay the
    one draw of its recording on every call."""
    if session_of(mesh).capturing:
        raise TraceError(f"{what} inside a monarch.compile'd step draws on the controller, once, while the step "
                         "is recorded, and every call would replay that draw; draw outside the step and pass the "
                         "tensor in, or use torch.randn/rand/randint without generator= (each call draws anew from "
                         "monarch.manual_seed's stream)")


@eager_under_torch_compile
def randn(*shape: Any, mesh: MeshLike, placements: PlacementsArg = None, dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None, device: Device = None) -> MeshTensor:
    return _random("randn", shape, mesh, placements, dtype, generator, device)


@eager_under_torch_compile
def rand(*shape: Any, mesh: MeshLike, placements: PlacementsArg = None, dtype: torch.dtype | None = None,
         generator: torch.Generator | None = None, device: Device = None) -> MeshTensor:
    return _random("rand", shape, mesh, placements, dtype, generator, device)


@eager_under_torch_compile
def randint(low: int, high: int, shape: Sequence[int], *, mesh: MeshLike, placements: PlacementsArg = None,
            dtype: torch.dtype | None = None, generator: torch.Generator | None = None, device: Device = None
            ) -> MeshTensor:
    return _random("randint", shape, mesh, placements, dtype or torch.int64, generator, device, low=low, high=high)


@eager_under_torch_compile
def arange(start: float, end: float | None = None, step: float = 1, *, mesh: MeshLike, placements: PlacementsArg = None,
           dtype: torch.dtype | None = None, device: Device = None) -> MeshTensor:
    if end is None:
        start, end = 0, start
    ref = torch.arange(start, end, step, dtype=dtype, device="meta")

    def make(ctx: Emit, spec: Spec) -> Local:
        first, length = spec.bounds(ctx.coords)[0]
        return Local("monarch::arange", (start, step, first, length, spec.dtype, spec.device), {}, ctx.out_ids)
    return _factory(mesh, tuple(ref.shape), ref.dtype, placements, make, "arange", device=device)


@eager_under_torch_compile
def distribute_tensor(tensor: torch.Tensor, mesh: MeshLike, placements: PlacementsArg = None) -> MeshTensor:
    """A MeshTensor holding a copy of `tensor`'s data, each rank receiving only its own piece, on the mesh's
    device (its GPUs on a CUDA mesh, as DTensor moves a tensor to its mesh's device type).

    A Partial placement keeps the data on the first rank of that dim (the others hold the reduction's
    identity), as redistributing a replicated tensor to Partial does. A MeshTensor of `mesh` is
    redistributed; one of another mesh (e.g. made by a factory inside another mesh's `activate()`) is
    fetched first, as a redistribution cannot cross meshes. A leaf gives a new leaf that requires grad
    when `tensor` does (a parameter); a tensor computed from others stays differentiable: in backward
    its gradient is fetched to the controller (or to the other mesh, placed as `tensor` was)."""
    s = session_of(mesh)
    if isinstance(tensor, MeshTensor) and tensor._backend is s:
        return tensor.redistribute(placements or {})
    if tensor.requires_grad and not tensor.is_leaf:
        return _Distribute.apply(tensor, mesh, placements)
    return _copy(tensor, mesh, placements).requires_grad_(tensor.requires_grad)


def _copy(tensor: torch.Tensor, mesh: MeshLike, placements: PlacementsArg, device: Device = None) -> MeshTensor:
    """distribute_tensor of a plain tensor or of a MeshTensor of another mesh, outside autograd, onto `device`
    (default: the mesh's); of a meta tensor, a meta MeshTensor (no data is sent or made)."""
    s = session_of(mesh)
    if isinstance(tensor, MeshTensor):
        tensor = tensor.full_tensor()
    ps = normalize(placements, s.abstract.labels, tensor.ndim, "distribute_tensor")
    if tensor.is_meta:  # a shape and placements: nothing is made on the workers until module.to_empty
        return s.meta(spec_of(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), ps, s.abstract, "meta"))
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in ps)
    data = tensor.detach().cpu().clone()

    def make(ctx: Emit, spec: Spec) -> Local:
        piece = data
        for d, (start, n) in enumerate(spec.bounds(ctx.coords)):
            piece = piece.narrow(d, start, n)
        return Local("monarch::constant", (piece.clone(), spec.device), {}, ctx.out_ids)
    return _factory(mesh, tuple(data.shape), data.dtype, whole, make, "distribute_tensor",
                    device=device).redistribute(ps)


class _Distribute(torch.autograd.Function):
    """distribute_tensor of a tensor computed from others: the gradient goes back where the tensor lives."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, mesh: MeshLike, placements: PlacementsArg) -> MeshTensor:
        ctx.source = (tensor.mesh, tensor.placements) if isinstance(tensor, MeshTensor) else None
        return _copy(tensor, mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: MeshTensor) -> tuple[torch.Tensor, None, None]:
        whole = grad.full_tensor()
        return (whole if ctx.source is None else _copy(whole, *ctx.source)), None, None


def rank(procs: MeshLike, dim: str) -> MeshTensor:
    """A tensor of shape (size(dim),) holding 0..n-1, sharded over `dim`: each rank holds its own index."""
    n = procs.size(dim)
    return arange(n, mesh=procs, placements={dim: Shard(0)})


@eager_under_torch_compile
def fetch(t: MeshTensor) -> Future[torch.Tensor]:
    """A Future of `t.full_tensor()` (everything pending runs)."""
    return t._backend.fetch(t)


@eager_under_torch_compile
def synchronize(procs: MeshLike | None = None, timeout: float | None = None) -> None:
    """Run everything pending on `procs` (or on every running mesh) and raise remote errors."""
    targets = [session_of(procs)] if procs is not None else [s for s in all_sessions() if s.live]
    for s in targets:
        s.synchronize(timeout)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Run `fn(*args)`; print and return its traced graph with specs, its outline as a DAG, and each
    rank's program."""
    sessions = {a._backend for a in args if isinstance(a, MeshTensor)}
    for s in sessions:
        assert isinstance(s, Session)
        s.flush()
    fn(*args, **kwargs)
    texts = []
    for s in sessions:
        assert isinstance(s, Session)
        traced = s.tracer.take()
        programs = partition(traced, FREE_BATCH)
        texts.append(f"graph on ({s.abstract.label()}) ({outline(traced)}):\n{traced}\n\n" +
                     "\n".join(str(p) for p in programs))
        s.ship(traced, programs)
    text = "\n\n".join(texts)
    print(text)
    return text


class _Factories(TorchFunctionMode):
    """Inside `procs.activate()` the mesh is the default device, as under `torch.set_default_device`: each
    torch factory that would make a tensor on the default device (`torch.randn`, `zeros`, `tensor`,
    `as_tensor`, `eye`, `linspace`, `randperm`, ...: torch's own list) makes a replicated MeshTensor on
    procs instead. Zeros, ones, empty, full, arange and monarch's random draws are made by the workers;
    the others are made here and distributed (a random one draws from monarch.manual_seed's stream, or
    with the `generator=` it is given, exactly as plain torch does). An explicit device is kept, as torch
    keeps it: `device="cpu"` (torch's own code asks for host tensors that way, e.g. Adam's `step`) makes a
    plain controller tensor, `device="meta"` a meta one; user code asking for the mesh's device by name
    is warned once, as is a sparse or nested factory (MeshTensors are dense)."""
    NATIVE = {torch.randn: randn, torch.rand: rand, torch.zeros: zeros, torch.ones: ones, torch.empty: empty}

    def __init__(self, procs: MeshLike) -> None:
        super().__init__()
        self.procs = procs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _CONSTRUCTORS or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        device = kwargs.get("device")
        ours = device is not None and torch.device(device).type == "cuda" == self.procs.device  # its GPUs
        if func not in _DENSE or (device is not None and not ours):
            _warn_plain(func, device)
            return func(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        made = self._native(func, args, kwargs)
        if made is None:
            if func in _RANDOM:
                given = "(..., generator=)" if kwargs.get("generator") is not None else ""
                _draws_here(self.procs, f"torch.{func.__name__}{given}")
                if kwargs.get("generator") is None:
                    kwargs = {**kwargs, "generator": torch.Generator().manual_seed(next_seed())}
            made = func(*args, **kwargs)
            return made if isinstance(made, MeshTensor) else distribute_tensor(made, self.procs)
        return made.requires_grad_(bool(kwargs.get("requires_grad")))

    def _native(self, func: Any, args: tuple, kwargs: dict) -> MeshTensor | None:
        """The factories the workers make, given sizes and at most dtype and requires_grad (else None)."""
        if any(v is not None and v is not False and k not in ("dtype", "requires_grad") for k, v in kwargs.items()):
            return None
        dtype, mine = kwargs.get("dtype"), self.NATIVE.get(func)
        if mine is not None and all(isinstance(a, (int, tuple, list, torch.Size)) for a in args):
            return mine(*args, mesh=self.procs, dtype=dtype)
        if func is torch.full and len(args) == 2:
            return full(*args[0], fill_value=args[1], mesh=self.procs, dtype=dtype)
        if func is torch.arange and args:
            return arange(*args, mesh=self.procs, dtype=dtype)
        if func is torch.randint and len(args) in (2, 3):
            *bounds, size = args  # randint(high, size) or randint(low, high, size)
            return randint(*([0] * (2 - len(bounds)) + bounds), size, mesh=self.procs, dtype=dtype)
        return None


_CONSTRUCTORS = frozenset(_device_constructors())  # what torch.set_default_device redirects
_DENSE = frozenset(f for f in _CONSTRUCTORS if not f.__name__.startswith(("sparse_", "nested_", "empty_quantized")))
_RANDOM = frozenset((torch.randn, torch.rand, torch.randint, torch.randperm))
_warned: set[str] = set()


def _warn_plain(func: Any, device: Any) -> None:
    """Once per process: a factory called by user code inside activate() makes a plain tensor, asked for
    the mesh's device (cpu) by name, or sparse or nested."""
    if device is not None and torch.device(device).type != "cpu":
        return
    caller = sys._getframe(2).f_globals.get("__name__", "")
    kind = "dense" if device is None else "device"
    if caller.split(".")[0] in ("torch", "monarch") or kind in _warned:
        return
    _warned.add(kind)
    why = (f"device={device!r} is kept, as under torch.set_default_device; drop device= for a replicated "
           "MeshTensor on the mesh" if device is not None else "MeshTensors are dense and strided")
    warnings.warn(f"torch.{func.__name__} inside procs.activate() makes a plain tensor on the controller: {why} "
                  "(shown once)", UserWarning, stacklevel=3)


@contextlib.contextmanager
def activate(procs: M) -> Iterator[M]:
    """`procs` as the default device: torch factories make replicated MeshTensors on it (see _Factories)."""
    with _Factories(procs):
        yield procs


FACTORIES: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    full, randn, rand, randint, arange, distribute_tensor)}


torch_state.install(distribute_tensor)  # loaded optimizer state lands like its parameter; torch.save guarded
register_tensor_api(sys.modules[__name__])  # ProcMesh.activate and ProcMesh.rank reach this module
serve(boundary)  # MeshTensor.to_local and from_local reach the session through it
