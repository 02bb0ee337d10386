"""The local/global boundary on the controller: `t.to_local()` fetches every rank's piece as a ValueMesh, and
`MeshTensor.from_local(pieces, mesh, placements)` makes a MeshTensor of pieces held here. Both are autograd
ops whose gradients are the chain rule's, so they equal plain torch's on the same pieces (README "DTensor
names"); per-rank code that never fetches runs in monarch.local_map instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from monarch.errors import MeshError, ShardingError
from monarch.graph.rules.table import Emit
from monarch.graph.trace import constant
from monarch.program.instr import Local
from monarch.runtime.control.futures import ValueMesh
from monarch.runtime.session.local_map import cotangent, grad_spec, gradient
from monarch.runtime.session.session import Session, session_of
from monarch.shape import DeviceMeshNames, MeshLike, Shape, SubMesh, default_mesh
from monarch.tensor.meshtensor import MeshTensor, PlacementsLike
from monarch.tensor.placement import Placement, Replicate, Shard, normalize
from monarch.tensor.spec import Spec


def to_local(t: MeshTensor, grad_placements: PlacementsLike) -> ValueMesh[torch.Tensor]:
    """`t`'s piece on each rank, by mesh point (see MeshTensor.to_local)."""
    s = _session(t)
    spec = grad_spec(t._spec, gradient(t.placements) if grad_placements is None else grad_placements,
                     "to_local(grad_placements=)")
    pieces = _ToLocal.apply(t, spec) if t.requires_grad and torch.is_grad_enabled() else _pieces(s, t)
    return ValueMesh(Shape.row_major(s.abstract.labels, s.abstract.sizes), list(pieces))


def from_local(local_tensor: Any, device_mesh: MeshLike | DeviceMeshNames | None, placements: PlacementsLike,
               run_check: bool, shape: Sequence[int] | None, stride: Sequence[int] | None) -> MeshTensor:
    """A MeshTensor of pieces held on the controller (see MeshTensor.from_local)."""
    mesh, placements, pieces = _pieces_by_rank(local_tensor, device_mesh, placements)
    s = session_of(mesh)
    first = pieces[0]
    ps = normalize(placements, s.abstract.labels, first.ndim, "from_local")
    spec = _global_spec(s, first, ps, shape, stride)
    for c, p in zip(s.abstract.coords(), pieces, strict=True):
        if tuple(p.shape) != spec.local_shape(c) or p.dtype != spec.dtype:
            raise ShardingError(f"from_local: the piece of rank {c} is {tuple(p.shape)} {p.dtype}, but a tensor of "
                                f"shape {spec.shape} placed {list(ps)} has a {spec.local_shape(c)} {spec.dtype} "
                                "piece there; pass shape= (the global shape) for uneven pieces, as torch.chunk "
                                "splits them")
    if run_check:
        _check_replicas(s, ps, pieces)
    if torch.is_grad_enabled() and any(p.requires_grad for p in pieces):
        return _FromLocal.apply(s, spec, *pieces)
    return _build(s, spec, pieces)


def _session(t: MeshTensor) -> Session:
    s = t._backend
    assert isinstance(s, Session), f"a MeshTensor's backend is a Session, not {type(s).__name__}"
    return s


def _pieces(s: Session, t: MeshTensor) -> list[torch.Tensor]:
    """Every rank's piece of `t` as it is (a Partial dim unreduced), in rank order (a sync point)."""
    return s.values(t).get()


def _pieces_by_rank(local_tensor: Any, device_mesh: MeshLike | DeviceMeshNames | None, placements: PlacementsLike
                    ) -> tuple[MeshLike, PlacementsLike, list[torch.Tensor]]:
    """The mesh of a from_local call, its placements, and one piece per rank of it in rank order. A submesh's
    pieces (by its points) repeat over the mesh's other dims, which replicate."""
    given = device_mesh if device_mesh is not None else default_mesh()
    if given is None:
        raise MeshError("from_local: no device_mesh given and no `with mesh:` block is open; pass device_mesh=")
    mesh: Any = given.root if isinstance(given, SubMesh) else given
    view = given.extent
    if isinstance(local_tensor, MeshTensor):
        raise ShardingError("from_local: local_tensor is a MeshTensor already; pass plain tensors (a ValueMesh of "
                            "them, a list in rank order, or one tensor for every rank)")
    if isinstance(local_tensor, torch.Tensor):
        own = [local_tensor] * view.nelements
    elif isinstance(local_tensor, ValueMesh):
        if tuple(local_tensor.extent.items()) != tuple(view.items()):
            raise ShardingError(f"from_local: a ValueMesh over {local_tensor.extent} for a mesh of {view}; give one "
                                "piece per point of the mesh")
        own = local_tensor.values()
    else:
        own = list(local_tensor)
        if len(own) != view.nelements:
            raise ShardingError(f"from_local: {len(own)} pieces for a mesh of {view}; give one per rank, in rank "
                                "order (row-major over the mesh dims)")
    if not all(isinstance(p, torch.Tensor) and not isinstance(p, MeshTensor) for p in own):
        raise ShardingError("from_local: every piece must be a plain torch.Tensor")
    if not isinstance(given, SubMesh):
        return mesh, placements, own
    dims = [mesh.extent.dim(d) for d in given.dims]
    index = Shape.row_major(given.dims, view.sizes)
    pieces = [own[index.rank_at(tuple(c[d] for d in dims))] for c in mesh.extent.coords()]
    return mesh, given.placements(placements), pieces


def _global_spec(s: Session, first: torch.Tensor, ps: tuple[Placement, ...], shape: Sequence[int] | None,
                 stride: Sequence[int] | None) -> Spec:
    """The global shape given, or DTensor's inference from rank 0's piece (even pieces: each Shard dim
    multiplies its tensor dim by the mesh dim's size); the stride given, or the contiguous one."""
    if shape is None:
        if stride is not None:
            raise ShardingError("from_local: stride= without shape=; pass both, or neither")
        sizes = list(first.shape)
        for p, n in zip(ps, s.abstract.sizes, strict=True):
            if isinstance(p, Shard):
                sizes[p.dim] *= n
        shape = sizes
    dims = tuple(int(n) for n in shape)
    strides = tuple(torch.empty(dims, device="meta").stride()) if stride is None else tuple(stride)
    if len(dims) != first.ndim or len(strides) != len(dims):
        raise ShardingError(f"from_local: shape {dims} and stride {strides} for pieces of {first.ndim} dims")
    return Spec(dims, strides, first.dtype, ps, s.abstract, s.mesh.device)


def _check_replicas(s: Session, ps: tuple[Placement, ...], pieces: list[torch.Tensor]) -> None:
    """run_check: each piece equals the piece at coordinate 0 of its Replicate dims."""
    index = {c: i for i, c in enumerate(s.abstract.coords())}
    differ = []
    for c, i in index.items():
        ref = index[tuple(0 if isinstance(p, Replicate) else x for p, x in zip(ps, c, strict=True))]
        if not torch.equal(pieces[i], pieces[ref]):
            differ.append(f"rank {i} {c} differs from rank {ref}")
    if differ:
        raise ShardingError(f"from_local(run_check=True): pieces placed Replicate {list(ps)} disagree: "
                            f"{'; '.join(differ)}; pass equal pieces over the Replicate dims (or Partial() if "
                            "they are to be summed)")


def _build(s: Session, spec: Spec, pieces: Sequence[torch.Tensor]) -> MeshTensor:
    """One node whose per-rank instruction makes the rank's own piece (copied now, sent at the flush)."""
    data = [p.detach().cpu().clone(memory_format=torch.contiguous_format) for p in pieces]
    index = {c: i for i, c in enumerate(s.abstract.coords())}

    def make(ctx: Emit) -> list[Local]:
        return [Local("monarch::constant", (data[index[ctx.coords]], spec.device), {}, ctx.out_ids)]
    node, ids = s.tracer.node(constant, (), (spec,), make)
    return s.tracer.wrap(spec, node, ids[0])


class _ToLocal(torch.autograd.Function):
    """to_local as an autograd op, one output per rank: the pieces' gradients form the tensor's, placed as
    `spec` says (a missing one counts as zeros)."""

    @staticmethod
    def forward(ctx: Any, t: MeshTensor, spec: Spec) -> tuple[torch.Tensor, ...]:
        ctx.session, ctx.spec = _session(t), spec
        ctx.set_materialize_grads(False)
        return tuple(_pieces(ctx.session, t))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[MeshTensor, None]:
        spec: Spec = ctx.spec
        shapes = [spec.local_shape(c) for c in spec.mesh.coords()]
        whole = [torch.zeros(n, dtype=spec.dtype) if g is None else g for g, n in zip(grads, shapes, strict=True)]
        return _build(ctx.session, spec, whole), None


class _FromLocal(torch.autograd.Function):
    """from_local as an autograd op, one input per rank: each piece's gradient is its share of the tensor's,
    the adjoint of assembling the pieces (a Shard piece gets its slice, a Partial one all of it, and a
    Replicate dim's value, read from its first piece as full_tensor reads it, sends it there)."""

    @staticmethod
    def forward(ctx: Any, s: Session, spec: Spec, *pieces: torch.Tensor) -> MeshTensor:
        ctx.session, ctx.placements = s, spec.placements
        return _build(s, spec, pieces)

    @staticmethod
    def backward(ctx: Any, grad: MeshTensor) -> tuple[torch.Tensor | None, ...]:
        placed = grad.redistribute(cotangent(ctx.placements))
        return (None, None, *_pieces(ctx.session, placed))
