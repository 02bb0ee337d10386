"""`MeshTensor`: a torch.Tensor subclass whose data lives in shards on a mesh of worker processes.

Every op on a MeshTensor meets monarch's tables in the order tensor/intercept.py sets: its backend (the
controller-side session of its mesh) records the op and returns new MeshTensors. The wrapper holds
no storage: only the global shape, stride and dtype, the Spec and a buffer handle.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from monarch.errors import ShardingError
from monarch.shape import DeviceMeshNames, MeshLike, SubMesh
from monarch.tensor import dynamo, intercept, ops
from monarch.tensor.intercept import Stages
from monarch.tensor.ops import batched
from monarch.tensor.placement import Placement, Replicate, normalize
from monarch.tensor.spec import Spec

PlacementsLike = Mapping[str, Placement] | Sequence[Placement] | None
_T = TypeVar("_T", bound=torch.Tensor)


class Backend(Stages, Protocol):
    """What a MeshTensor needs from the runtime of its mesh: the stages of an op, and these."""
    mesh: MeshLike

    def redistribute(self, t: MeshTensor, placements: tuple[Placement, ...]) -> MeshTensor: ...

    def fetch(self, t: MeshTensor) -> Any: ...

    def place(self, t: torch.Tensor, placements: tuple[Placement, ...] | None) -> MeshTensor:
        """A MeshTensor of plain `t`'s data, placed as `placements` (None: replicated)."""

    def rebind(self, target: MeshTensor, source: MeshTensor) -> None:
        """`target` names `source`'s buffer from now on (with its spec)."""

    def to_mesh(self, t: MeshTensor, mesh: MeshLike, placements: Mapping[str, Placement] | Sequence[Placement] | None
                ) -> MeshTensor:
        """`t` moved to another mesh, rank to rank."""


class MeshTensor(torch.Tensor):
    """A global tensor sharded over a mesh; behaves like a plain tensor under torch ops."""
    _spec: Spec
    _backend: Backend
    _handle: Any
    __slots__ = ("_spec", "_backend", "_handle")
    __tensor_flatten__ = dynamo.NotTraceable()  # what Dynamo asks first of each MeshTensor it meets

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Plain torch semantics (results are not wrapped again), except for the composite ops monarch
        records its own way (step 1 of tensor/intercept.py)."""
        return intercept.torch_function(func, args, kwargs or {})

    @staticmethod
    def __new__(cls, spec: Spec, backend: Backend, handle: Any, requires_grad: bool = False) -> MeshTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype,
                                                device=torch.device("cpu"), requires_grad=requires_grad)
        t._spec, t._backend, t._handle = spec, backend, handle
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        """Every aten op: recorded by the backend of its mesh (steps 2 to 5 of tensor/intercept.py)."""
        return intercept.dispatch(backend_of(func, args, kwargs), func, args, kwargs or {})

    # -- sharding --------------------------------------------------------------------------------
    @property
    def mesh(self) -> MeshLike:
        """The proc mesh (view) holding the shards."""
        return self._backend.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        """Where the workers keep the pieces: cpu, or cuda (each worker's own GPU). To torch's C++ code the
        controller-side wrapper is a CPU tensor, so autograd needs no CUDA on the controller."""
        return torch.device(self._spec.device)

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return self._spec.device == "cuda"

    @property  # type: ignore[override]
    def is_cpu(self) -> bool:
        return self._spec.device == "cpu"

    @property  # type: ignore[override]
    def is_meta(self) -> bool:
        """Placed from a meta tensor: a shape and placements, no data anywhere (`module.to_empty` makes it)."""
        return self._spec.device == "meta"

    @property
    def spec(self) -> Spec:
        return self._spec

    def redistribute(self, device_mesh: MeshLike | DeviceMeshNames | PlacementsLike = None,
                     placements: PlacementsLike = None, *, async_op: bool = False,
                     forward_dtype: torch.dtype | None = None, backward_dtype: torch.dtype | None = None
                     ) -> MeshTensor:
        """The same global tensor with new placements (collectives run on the workers, asynchronously
        whatever `async_op` says: every op is). Monarch's forms `t.redistribute({"tp": Shard(0)})` and
        `t.redistribute([...])` stand next to DTensor's `t.redistribute(mesh, [...])`, where the mesh is
        the tensor's own or a submesh `mesh["tp"]` of it (then the placements name its dims, the other
        dims Replicate). `forward_dtype` converts the pieces first; with it or `backward_dtype`, the
        gradient is converted to `backward_dtype` (default: this tensor's dtype), redistributed back to
        these placements (a Partial dim gets Replicate) and converted to this tensor's dtype, as DTensor's
        backward does; without either, the gradient passes back as it is placed."""
        if isinstance(device_mesh, (Mapping, list, tuple)):
            if placements is not None:
                raise ShardingError("redistribute: placements given twice; call t.redistribute(placements) or "
                                    "t.redistribute(device_mesh, placements)")
            device_mesh, placements = None, device_mesh
        target = normalize(_on_own_mesh(self, device_mesh, placements), self._spec.mesh.labels, self.ndim,
                           "redistribute")
        dtype = forward_dtype or self.dtype
        if target == self._spec.placements and dtype == self.dtype:
            return self
        back = None if forward_dtype is None and backward_dtype is None else backward_dtype or self.dtype
        return _Redistribute.apply(self, target, dtype, back)

    def to_mesh(self, mesh: MeshLike, placements: Mapping[str, Placement] | Sequence[Placement] | None = None
                ) -> MeshTensor:
        """This tensor on another mesh, placed as `placements` (default: replicated): the shards move straight
        from this mesh's ranks to `mesh`'s ranks (one-sided reads; never through the controller) and are
        redistributed on the way. Differentiable: the gradient goes back to this mesh."""
        return self._backend.to_mesh(self, mesh, placements)

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`t.data = new` (as `module.to(dtype)`, `.half()` and `.double()` do for a MeshTensor parameter):
        `t` names `new`'s shards from now on, with its shape and dtype, keeping its own requires_grad. A
        plain tensor is placed first: like `t` when the shapes agree, else replicated."""
        if not isinstance(new, MeshTensor):
            new = self._backend.place(new, self._spec.placements if new.shape == self.shape else None)
        elif new._backend is not self._backend:
            raise ShardingError(f"t.data = new: new is a MeshTensor of {new.mesh!r}, not of {self.mesh!r}; "
                                "a tensor's data cannot move across meshes; assign "
                                "monarch.distribute_tensor(new.full_tensor(), t.mesh, t.placements)")
        _TENSOR_DATA.__set__(self, new)
        self._backend.rebind(self, new)

    def __matmul__(self, other: Any) -> Any:
        if batched(self, other):
            return ops.matmul(self, other)
        return super().__matmul__(other)

    def __rmatmul__(self, other: Any) -> Any:
        if batched(other, self):
            return ops.matmul(other, self)
        return super().__rmatmul__(other)

    def matmul(self, other: Any) -> Any:  # type: ignore[override]
        return self.__matmul__(other)

    # -- sync points -----------------------------------------------------------------------------
    def full_tensor(self, timeout: float | None = None, *, grad_placements: PlacementsLike = None) -> torch.Tensor:
        """The whole tensor as a plain torch.Tensor on the controller (runs everything pending).
        Differentiable: a gradient reaching it is placed as `grad_placements` (default Replicate), then
        redistributed to this tensor's placements as redistribute's backward does (DTensor's rule)."""
        if not (self.requires_grad and torch.is_grad_enabled()):
            return self._value(timeout)
        ps = normalize(grad_placements, self._spec.mesh.labels, self.ndim, "full_tensor(grad_placements=)")
        return _FullTensor.apply(self, ps, timeout)

    def _value(self, timeout: float | None = None) -> torch.Tensor:
        return self._backend.fetch(self).get(timeout)

    def to_local(self, *, grad_placements: PlacementsLike = None) -> Any:
        """Each rank's local piece, fetched to the controller: a ValueMesh of plain tensors by mesh point
        (a sync point). Differentiable: the pieces' gradients form this tensor's, placed as
        `grad_placements` (default: Shard where this tensor is sharded, else Partial, summing them)."""
        return _boundary().to_local(self, grad_placements)

    @staticmethod
    def from_local(local_tensor: Any, device_mesh: MeshLike | DeviceMeshNames | None = None,
                   placements: PlacementsLike = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None) -> MeshTensor:
        """A MeshTensor from local pieces: a ValueMesh of them, a list in rank order (row-major over the
        mesh dims), or one tensor as the piece of every rank. `shape`/`stride` give the global shape of
        uneven pieces (default: even ones, as DTensor infers); `run_check` checks that Replicate pieces
        agree. Differentiable: each piece gets its part of the gradient."""
        return _boundary().from_local(local_tensor, device_mesh, placements, run_check, shape, stride)

    def item(self) -> Any:  # type: ignore[override]
        return self._value().item()

    def tolist(self) -> Any:  # type: ignore[override]
        return self._value().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        return self._value().numpy()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        where = f"mesh=({self._spec.mesh.label()}), placements={self._spec.placement_str()}"
        if self.is_meta:
            return f"MeshTensor(..., size={tuple(self.shape)}, device='meta', {where})"
        with contextlib.ExitStack() as modes:  # off while fetching and printing: activate()'s factories would
            for _ in range(torch._C._len_torch_function_stack()):  # make their tensors MeshTensors
                modes.enter_context(torch.overrides._pop_mode_temporarily())
            body = repr(self._value())
        return f"MeshTensor({body}, {where})"

    __str__ = __repr__  # type: ignore[assignment]

    def __format__(self, spec: str) -> str:
        return self._value().__format__(spec)

    def __reduce_ex__(self, proto: Any) -> Any:
        raise ShardingError("a MeshTensor cannot be pickled (its data lives on the workers); call .full_tensor() "
                            "to get its data, save monarch.full_state_dict(model or optimizer) rather than a "
                            "state_dict() of MeshTensors, or pass it to a compiled function instead of an actor "
                            "endpoint")

    @property
    def device_mesh(self) -> MeshLike:
        """DTensor's name of `mesh`: the whole mesh, with one placement per dim (also for a tensor placed on
        a submesh `mesh["tp"]`, which is Replicate over the other dims)."""
        return self._backend.mesh


_TENSOR_DATA = torch._C.TensorBase.data  # torch's own `.data` (shape, dtype and stride of the wrapper)


class _Redistribute(torch.autograd.Function):
    """Redistribution as an autograd op (pieces converted to `dtype` first). Without a backward dtype
    the gradient passes through as it is (a global tensor's values do not depend on its placements, so
    the gradient's own placements are as good as any); with one, as DTensor's backward (`_placed_back`)."""

    @staticmethod
    def forward(ctx: Any, t: MeshTensor, placements: tuple[Placement, ...], dtype: torch.dtype,
                back: torch.dtype | None) -> MeshTensor:
        ctx.source, ctx.back = (t._spec.placements, t.dtype), back
        return t._backend.redistribute(_as(t, dtype), placements)

    @staticmethod
    def backward(ctx: Any, grad: MeshTensor) -> tuple[torch.Tensor, None, None, None]:
        placements, dtype = ctx.source
        if ctx.back is not None:
            grad = _placed_back(_as(grad, ctx.back), placements)
        return _as(grad, dtype), None, None, None


def _as(t: _T, dtype: torch.dtype) -> _T:
    """`t` in `dtype` (itself when it is already)."""
    return t if t.dtype == dtype else t.to(dtype)  # type: ignore[return-value] - to() keeps the subclass


def _placed_back(grad: MeshTensor, placements: tuple[Placement, ...]) -> MeshTensor:
    """A gradient redistributed to an input's placements, a Partial dim getting Replicate (DTensor's rule)."""
    return grad.redistribute(tuple(Replicate() if p.is_partial() else p for p in placements))


def _on_own_mesh(t: MeshTensor, mesh: MeshLike | DeviceMeshNames | None, placements: PlacementsLike
                 ) -> PlacementsLike:
    """`placements` for the dims of `t`'s mesh, given for `mesh` (None, `t`'s mesh or a submesh of it)."""
    if mesh is None or mesh is t.mesh or mesh == t.mesh:
        return placements
    if isinstance(mesh, SubMesh) and (mesh.root is t.mesh or mesh.root == t.mesh):
        return mesh.placements(placements)
    raise ShardingError(f"redistribute: device_mesh {mesh!r} is not the tensor's mesh {t.mesh!r} nor a submesh "
                        "of it; a redistribution cannot cross meshes: move the tensor with t.to_mesh(mesh, "
                        "placements)")


class _FullTensor(torch.autograd.Function):
    """full_tensor as an autograd op: the controller's gradient goes back to the mesh."""

    @staticmethod
    def forward(ctx: Any, t: MeshTensor, grad_placements: tuple[Placement, ...], timeout: float | None
                ) -> torch.Tensor:
        ctx.backend, ctx.placements, ctx.grad_placements = t._backend, t._spec.placements, grad_placements
        return t._value(timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[MeshTensor, None, None]:
        return _placed_back(ctx.backend.place(grad, ctx.grad_placements), ctx.placements), None, None


class Boundary(Protocol):
    """The controller's side of to_local and from_local (monarch.runtime.session.boundary, which registers
    itself with `serve` when the tensor API loads)."""

    def to_local(self, t: MeshTensor, grad_placements: PlacementsLike) -> Any: ...

    def from_local(self, local_tensor: Any, device_mesh: MeshLike | DeviceMeshNames | None,
                   placements: PlacementsLike, run_check: bool, shape: Sequence[int] | None,
                   stride: Sequence[int] | None) -> MeshTensor: ...


_BOUNDARY: list[Boundary] = []


def serve(boundary: Boundary) -> None:
    _BOUNDARY[:] = [boundary]


def _boundary() -> Boundary:
    if not _BOUNDARY:
        raise ShardingError("to_local/from_local need monarch's tensor API, which is not loaded yet: import "
                            "monarch.dtensor (or make a tensor with monarch.distribute_tensor) first")
    return _BOUNDARY[0]


def backend_of(func: Any, args: tuple, kwargs: dict | None) -> Backend:
    """The one backend of the MeshTensor arguments; tensors of two meshes fail here, before anything is
    recorded or shipped (a redistribution cannot cross meshes)."""
    if not kwargs and len(args) == 1 and type(args[0]) is MeshTensor:  # the common unary op: nothing to compare
        return args[0]._backend
    found: Backend | None = None
    for a in _tensor_args(args, kwargs):
        if found is None:
            found = a._backend
        elif a._backend is not found:
            raise ShardingError(
                f"{func}: tensors of two meshes in one op, {found.mesh!r} and {a._backend.mesh!r}; compute on "
                "one mesh: a redistribution cannot cross meshes, so move the data explicitly, e.g. "
                "monarch.distribute_tensor(t.full_tensor(), mesh, placements)")
    assert found is not None, "__torch_dispatch__ without a MeshTensor argument"
    return found


def _tensor_args(args: tuple, kwargs: dict | None) -> Iterator[MeshTensor]:
    """The MeshTensor arguments of an aten call (top level, or in a list such as torch.cat's)."""
    for a in (*args, *(kwargs or {}).values()):
        if type(a) is MeshTensor:
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if type(b) is MeshTensor)


dynamo.run_eagerly(MeshTensor, _Redistribute, _FullTensor)
