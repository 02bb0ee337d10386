"""The sharded-tensor API on the controller: distribute_tensor, factories, fetch, local_map, explain.

Factories record one node whose per-rank instruction creates the rank's piece on the worker; random
factories draw the global tensor from a seed (so the values do not depend on the placement) and keep
the piece. `activate(procs)` makes plain `torch.randn(...)` and friends create MeshTensors.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from monarch.errors import ShardingError
from monarch.graph.partition import outline, partition
from monarch.graph.rules.common import random_piece
from monarch.graph.rules.table import Emit
from monarch.program.instr import Buf, Local
from monarch.runtime.control import codec
from monarch.runtime.control.client import register_tensor_api
from monarch.runtime.control.futures import Future
from monarch.runtime.engine import kernels
from monarch.runtime.session import torch_state
from monarch.runtime.session.session import Session, all_sessions, session_of
from monarch.tensor.meshtensor import MeshTensor, eager_under_torch_compile
from monarch.tensor.placement import Partial, Placement, Replicate, Shard, normalize
from monarch.tensor.spec import Spec

PlacementsArg = Mapping[str, Placement] | Sequence[Placement] | None


def _factory(procs: Any, shape: Sequence[int], dtype: torch.dtype | None, placements: PlacementsArg,
             make: Callable[[Emit, Spec], Local], what: str, seeded: bool = False) -> MeshTensor:
    s = session_of(procs)
    shape = _dims(shape)
    dtype = dtype or torch.get_default_dtype()
    ps = normalize(placements, s.abstract.labels, len(shape), what)
    if any(isinstance(p, Partial) for p in ps):
        raise ShardingError(f"{what}: a new tensor cannot be Partial {ps}; create it Replicate and redistribute")
    meta = torch.empty(shape, dtype=dtype, device="meta")
    spec = Spec(shape, tuple(meta.stride()), dtype, ps, s.abstract)
    node, ids = s.tracer.node(FACTORIES[what], (), (spec,), lambda ctx: [make(ctx, spec)])
    if seeded:
        s.tracer.seeded(node)
    return s.tracer.wrap(spec, node, ids[0])


def _dims(shape: Sequence[Any]) -> tuple[int, ...]:
    """A factory's shape, given as sizes or as one tuple or list of them."""
    return tuple(int(n) for n in (shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape))


@eager_under_torch_compile
def full(*shape: Any, fill_value: float, mesh: Any, placements: PlacementsArg = None,
         dtype: torch.dtype | None = None) -> MeshTensor:
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    return _factory(mesh, shape, dtype, placements, lambda ctx, spec: Local(
        "aten::full", (list(spec.local_shape(ctx.coords)), fill_value), {"dtype": spec.dtype}, ctx.out_ids), "full")


def zeros(*shape: Any, mesh: Any, placements: PlacementsArg = None, dtype: torch.dtype | None = None) -> MeshTensor:
    return full(*shape, fill_value=0, mesh=mesh, placements=placements, dtype=dtype or torch.get_default_dtype())


def ones(*shape: Any, mesh: Any, placements: PlacementsArg = None, dtype: torch.dtype | None = None) -> MeshTensor:
    return full(*shape, fill_value=1, mesh=mesh, placements=placements, dtype=dtype or torch.get_default_dtype())


def empty(*shape: Any, mesh: Any, placements: PlacementsArg = None, dtype: torch.dtype | None = None) -> MeshTensor:
    """Like zeros (workers fill new buffers, so no uninitialised memory is ever read)."""
    return zeros(*shape, mesh=mesh, placements=placements, dtype=dtype)


def _random(kind: str, shape: Sequence[Any], mesh: Any, placements: PlacementsArg, dtype: torch.dtype | None,
            generator: torch.Generator | None, **kw: Any) -> MeshTensor:
    """Drawn from monarch.manual_seed's stream on the workers; or, given the user's `generator`, drawn
    with it here (the numbers and generator state plain torch gives) and distributed."""
    if generator is not None:
        data = kernels.RANDOM[kind](_dims(shape), generator, dtype=dtype or torch.get_default_dtype(), **kw)
        return distribute_tensor(data, mesh, placements)

    def make(ctx: Emit, spec: Spec) -> Local:
        return random_piece(ctx, kind, spec, {"dtype": spec.dtype, **kw}, ctx.out_ids[0])
    return _factory(mesh, shape, dtype, placements, make, kind, seeded=True)


@eager_under_torch_compile
def randn(*shape: Any, mesh: Any, placements: PlacementsArg = None, dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None) -> MeshTensor:
    return _random("randn", shape, mesh, placements, dtype, generator)


@eager_under_torch_compile
def rand(*shape: Any, mesh: Any, placements: PlacementsArg = None, dtype: torch.dtype | None = None,
         generator: torch.Generator | None = None) -> MeshTensor:
    return _random("rand", shape, mesh, placements, dtype, generator)


@eager_under_torch_compile
def randint(low: int, high: int, shape: Sequence[int], *, mesh: Any, placements: PlacementsArg = None,
            dtype: torch.dtype | None = None, generator: torch.Generator | None = None) -> MeshTensor:
    return _random("randint", shape, mesh, placements, dtype or torch.int64, generator, low=low, high=high)


@eager_under_torch_compile
def arange(start: float, end: float | None = None, step: float = 1, *, mesh: Any, placements: PlacementsArg = None,
           dtype: torch.dtype | None = None) -> MeshTensor:
    if end is None:
        start, end = 0, start
    ref = torch.arange(start, end, step, dtype=dtype, device="meta")

    def make(ctx: Emit, spec: Spec) -> Local:
        first, length = spec.bounds(ctx.coords)[0]
        return Local("monarch::arange", (start, step, first, length, spec.dtype), {}, ctx.out_ids)
    return _factory(mesh, tuple(ref.shape), ref.dtype, placements, make, "arange")


@eager_under_torch_compile
def distribute_tensor(tensor: torch.Tensor, mesh: Any, placements: PlacementsArg = None) -> MeshTensor:
    """A MeshTensor holding a copy of `tensor`'s data, each rank receiving only its own piece.

    A Partial placement keeps the data on the first rank of that dim (the others hold the reduction's
    identity), as redistributing a replicated tensor to Partial does. A MeshTensor of `mesh` is
    redistributed; one of another mesh (e.g. made by a factory inside another mesh's `activate()`) is
    fetched first, as a redistribution cannot cross meshes."""
    s = session_of(mesh)
    grad = tensor.requires_grad
    if isinstance(tensor, MeshTensor):
        if tensor._backend is s:
            return tensor.redistribute(placements or {})
        tensor = tensor.full_tensor()
    ps = normalize(placements, s.abstract.labels, tensor.ndim, "distribute_tensor")
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in ps)
    data = tensor.detach().clone()

    def make(ctx: Emit, spec: Spec) -> Local:
        piece = data
        for d, (start, n) in enumerate(spec.bounds(ctx.coords)):
            piece = piece.narrow(d, start, n)
        return Local("monarch::constant", (piece.clone(),), {}, ctx.out_ids)
    t = _factory(mesh, tuple(data.shape), data.dtype, whole, make, "distribute_tensor").redistribute(ps)
    if grad:
        t.requires_grad_(True)
    return t


def rank(procs: Any, dim: str) -> MeshTensor:
    """A tensor of shape (size(dim),) holding 0..n-1, sharded over `dim`: each rank holds its own index."""
    n = procs.size(dim)
    return arange(n, mesh=procs, placements={dim: Shard(0)})


@eager_under_torch_compile
def fetch(t: MeshTensor) -> Future[torch.Tensor]:
    """A Future of `t.full_tensor()` (everything pending runs)."""
    return t._backend.fetch(t)


@eager_under_torch_compile
def synchronize(procs: Any | None = None, timeout: float | None = None) -> None:
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
        programs = partition(traced)
        texts.append(f"graph on ({s.abstract.label()}) ({outline(traced)}):\n{traced}\n\n" +
                     "\n".join(str(p) for p in programs))
        s.ship(traced, programs)
    text = "\n\n".join(texts)
    print(text)
    return text


class _Factories(TorchFunctionMode):
    """Inside `procs.activate()`: plain torch factories create replicated MeshTensors on procs. Given a
    `generator=`, a random factory draws with it here, exactly as plain torch does, and distributes that."""
    NAMES = {torch.randn: randn, torch.rand: rand, torch.zeros: zeros, torch.ones: ones, torch.empty: empty}
    RANDOM = (torch.randn, torch.rand, torch.randint)

    def __init__(self, procs: Any) -> None:
        super().__init__()
        self.procs = procs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is None and kwargs.get("out") is None:
            if kwargs.get("generator") is not None:
                return distribute_tensor(func(*args, **kwargs), self.procs) if func in self.RANDOM else \
                    func(*args, **kwargs)
            mine = self.NAMES.get(func)
            if mine is not None:
                return mine(*args, mesh=self.procs, dtype=kwargs.get("dtype"))
            if func is torch.full:
                return full(*args[0], fill_value=args[1] if len(args) > 1 else kwargs["fill_value"],
                            mesh=self.procs, dtype=kwargs.get("dtype"))
            if func is torch.arange:
                return arange(*args, mesh=self.procs, dtype=kwargs.get("dtype"))
            if func is torch.randint:
                *bounds, size = args  # randint(high, size) or randint(low, high, size)
                return randint(*([0] * (2 - len(bounds)) + bounds), size, mesh=self.procs, dtype=kwargs.get("dtype"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def activate(procs: Any) -> Iterator[Any]:
    with _Factories(procs):
        yield procs


def local_map(fn: Callable[..., Any], in_placements: Sequence[PlacementsArg | None],
              out_placements: PlacementsArg | Sequence[PlacementsArg]) -> Callable[..., Any]:
    """`fn` run on each rank's local pieces: MeshTensor arguments are redistributed to `in_placements`
    (one entry per positional argument; None keeps a tensor as it is), and the local results form
    MeshTensors placed as `out_placements` (one entry per output when fn returns a tuple)."""
    blob, name = codec.dumps(fn), getattr(fn, "__qualname__", repr(fn))

    @eager_under_torch_compile
    def run(*args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, MeshTensor)]
        if not tensors or len(in_placements) != len(args):
            raise ShardingError(f"local_map({getattr(fn, '__name__', fn)}): give one in_placements entry per "
                                f"argument ({len(args)}), and at least one MeshTensor argument")
        s = tensors[0]._backend
        assert isinstance(s, Session)
        moved = [a.redistribute(p) if isinstance(a, MeshTensor) and p is not None else a
                 for a, p in zip(args, in_placements, strict=True)]
        ins = [a for a in moved if isinstance(a, MeshTensor)]
        multi = isinstance(out_placements, (list, tuple)) and bool(out_placements) and \
            not isinstance(out_placements[0], Placement)
        outs: list[Any] = list(out_placements) if multi else [out_placements]  # type: ignore[arg-type]
        specs = _local_map_specs(fn, moved, outs, s)
        srcs = [s.tracer._moved(t, t._spec) for t in ins]
        it = iter([Buf(i) for _, i in srcs])
        local_args = tuple(next(it) if isinstance(a, MeshTensor) else a for a in moved)

        def make(ctx: Emit) -> list[Local]:  # the worker checks fn's results against this rank's plan
            planned = tuple((spec.local_shape(ctx.coords), spec.dtype) for spec in specs)
            return [Local("monarch::local_map", (blob, name, planned, *local_args), {}, ctx.out_ids)]
        node, ids = s.tracer.node(fn, tuple(n for n, _ in srcs), specs, make)
        results = [s.tracer.wrap(spec, node, i) for spec, i in zip(specs, ids, strict=True)]
        return tuple(results) if multi else results[0]
    return run


def _local_map_specs(fn: Callable[..., Any], args: list[Any], outs: list[PlacementsArg],
                     s: Session) -> tuple[Spec, ...]:
    """Global output specs, from running fn on meta tensors of every rank's local shapes."""
    per_rank = []
    for coords in s.abstract.coords():
        metas = [torch.empty(a._spec.local_shape(coords), dtype=a.dtype, device="meta")
                 if isinstance(a, MeshTensor) else a for a in args]
        r = fn(*metas)
        per_rank.append(list(r) if isinstance(r, (tuple, list)) else [r])
    if len(per_rank[0]) != len(outs):
        raise ShardingError(f"local_map: fn returns {len(per_rank[0])} tensors but out_placements has {len(outs)}")
    specs = []
    for k, placements in enumerate(outs):
        local = [r[k] for r in per_rank]
        ps = normalize(placements, s.abstract.labels, local[0].ndim, "local_map out_placements")
        shape = list(local[0].shape)
        for d in {p.dim for p in ps if isinstance(p, Shard)}:
            shape[d] = sum(m.shape[d] for c, m in zip(s.abstract.coords(), local, strict=True)
                           if all(ci == 0 for ci, p in zip(c, ps, strict=True) if not p.is_shard(d)))
        meta = torch.empty(shape, dtype=local[0].dtype, device="meta")
        spec = Spec(tuple(shape), tuple(meta.stride()), meta.dtype, ps, s.abstract)
        for c, m in zip(s.abstract.coords(), local, strict=True):
            if spec.local_shape(c) != tuple(m.shape):
                raise ShardingError(f"local_map: rank {c} returned shape {tuple(m.shape)}, but output {k} placed "
                                    f"{ps} of global shape {tuple(shape)} needs {spec.local_shape(c)} there "
                                    "(pieces must be torch.chunk pieces)")
        specs.append(spec)
    return tuple(specs)


FACTORIES: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    full, randn, rand, randint, arange, distribute_tensor)}


torch_state.install(distribute_tensor)  # loaded optimizer state lands like its parameter; torch.save guarded
register_tensor_api(sys.modules[__name__])  # ProcMesh.activate and ProcMesh.rank reach this module
