"""`monarch.local_map`: a function run on each rank's local pieces, forward and backward.

The forward records one node whose per-rank instruction runs fn on the rank's pieces (checked against
the plan traced on meta tensors). When an input requires grad, each worker keeps fn's autograd graph (a
tape, held as one more buffer), and the backward records a node running that graph's backward on the
rank's pieces of the output gradients, so gradients equal plain torch's.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from monarch.errors import ShardingError
from monarch.graph.rules.table import Emit
from monarch.program.instr import Buf, Local
from monarch.runtime.control import codec
from monarch.runtime.session.session import Session, _target
from monarch.tensor.dynamo import eager_under_torch_compile
from monarch.tensor.meshtensor import MeshTensor, PlacementsLike, backend_of
from monarch.tensor.placement import Partial, Placement, Replicate, Shard, normalize
from monarch.tensor.spec import Spec

_BACKWARD = "monarch::local_map_backward"


def local_map(fn: Callable[..., Any], in_placements: Sequence[PlacementsLike | None],
              out_placements: PlacementsLike | Sequence[PlacementsLike]) -> Callable[..., Any]:
    """`fn` run on each rank's local pieces: MeshTensor arguments are redistributed to `in_placements`
    (one entry per positional argument; None keeps a tensor as it is), and the local results form
    MeshTensors placed as `out_placements` (one entry per output when fn returns a tuple).

    Differentiable: each rank's backward is the backward of its own call of fn. An input's gradient is
    placed Shard where the input is sharded and Partial(sum) elsewhere (each rank's contribution); an
    output's gradient reaches the ranks as the output is placed, with Replicate and Partial swapped
    (a replicated output counts once, each piece of a Partial one gets the whole gradient)."""
    return mapped(fn, in_placements, out_placements)


def mapped(fn: Callable[..., Any], in_placements: Sequence[PlacementsLike | None],
           out_placements: PlacementsLike | Sequence[PlacementsLike],
           in_grad_placements: Sequence[PlacementsLike | None] | None = None) -> Callable[..., Any]:
    """local_map, with the placements of the inputs' gradients when given (one entry per argument; None
    keeps the rule above), as DTensor's local_map takes them."""
    blob, name = codec.dumps(fn), getattr(fn, "__qualname__", repr(fn))

    @eager_under_torch_compile
    def run(*args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, MeshTensor)]
        if not tensors or len(in_placements) != len(args):
            raise ShardingError(f"local_map({getattr(fn, '__name__', fn)}): give one in_placements entry per "
                                f"argument ({len(args)}), and at least one MeshTensor argument")
        s = backend_of(f"local_map({name})", tuple(tensors), None)
        assert isinstance(s, Session)
        moved = [a.redistribute(p) if isinstance(a, MeshTensor) and p is not None else a
                 for a, p in zip(args, in_placements, strict=True)]
        multi = isinstance(out_placements, (list, tuple)) and bool(out_placements) and \
            not isinstance(out_placements[0], Placement)
        outs: list[Any] = list(out_placements) if multi else [out_placements]
        grads = tuple(None if g is None or not isinstance(a, MeshTensor) else
                      grad_spec(a._spec, g, f"local_map({name}) in_grad_placements")
                      for a, g in zip(moved, in_grad_placements or [None] * len(moved), strict=True))
        call = _Call(fn, blob, name, s, tuple(moved), _specs(fn, moved, outs, s), grads)
        ins = [a for a in moved if isinstance(a, MeshTensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in ins):
            results = _LocalMap.apply(call, *ins)
        else:
            results = call.forward(())
        return tuple(results) if multi else results[0]
    return run


@dataclass(frozen=True)
class _Call:
    """One call of a local_map'd function: fn pickled, its arguments (MeshTensors placed as fn gets them)
    and the specs of its results."""
    fn: Callable[..., Any]
    blob: bytes
    name: str
    session: Session
    args: tuple[Any, ...]
    specs: tuple[Spec, ...]
    grads: tuple[Spec | None, ...]  # per argument: its gradient's spec when given, else None (the rule)

    def forward(self, needs: tuple[int, ...]) -> list[MeshTensor]:
        """The results; with `needs` (positions of the arguments that need a gradient), also the tape."""
        tracer = self.session.tracer
        ins = [a for a in self.args if isinstance(a, MeshTensor)]
        srcs = [tracer.moved(t, t._spec) for t in ins]
        bufs = iter([Buf(i) for _, i in srcs])
        local_args = tuple(next(bufs) if isinstance(a, MeshTensor) else a for a in self.args)
        specs = self.specs + ((self.session.value_spec(),) if needs else ())

        def make(ctx: Emit) -> list[Local]:  # the worker checks fn's results against this rank's plan
            planned = tuple((spec.local_shape(ctx.coords), spec.dtype) for spec in self.specs)
            args = (self.blob, self.name, planned, needs, *local_args)
            return [Local("monarch::local_map", args, {}, ctx.out_ids)]
        node, ids = tracer.node(self.fn, tuple(n for n, _ in srcs), specs, make)
        return [tracer.wrap(spec, node, i) for spec, i in zip(specs, ids, strict=True)]

    def backward(self, tape: MeshTensor, inputs: tuple[Spec, ...],
                 grads: Sequence[MeshTensor | None]) -> list[MeshTensor]:
        """The gradients, specs `inputs`, of the arguments that needed one from the outputs' (None: no
        gradient reached that output)."""
        tracer = self.session.tracer
        placed = [None if g is None else g.redistribute(cotangent(spec.placements))
                  for g, spec in zip(grads, self.specs, strict=True)]
        srcs = [tracer.moved(t, t._spec) for t in (tape, *(g for g in placed if g is not None))]
        bufs = iter([Buf(i) for _, i in srcs])
        args = (next(bufs), *(None if g is None else next(bufs) for g in placed))
        node, ids = tracer.node(_target(_BACKWARD), tuple(n for n, _ in srcs), inputs,
                                lambda ctx: [Local(_BACKWARD, args, {}, ctx.out_ids)])
        return [tracer.wrap(spec, node, i) for spec, i in zip(inputs, ids, strict=True)]


class _LocalMap(torch.autograd.Function):
    """A local_map call as an autograd op: the forward keeps a tape on each rank, the backward uses it."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *ins: MeshTensor) -> tuple[MeshTensor, ...]:
        positions = [i for i, a in enumerate(call.args) if isinstance(a, MeshTensor)]
        needs = tuple(p for p, t in zip(positions, ins, strict=True) if t.requires_grad)
        ctx.call, ctx.wanted = call, [t.requires_grad for t in ins]
        ctx.inputs = tuple(call.grads[p] or t._spec.with_placements(gradient(t.placements))
                           for p, t in zip(positions, ins, strict=True) if t.requires_grad)
        *outs, tape = call.forward(needs)
        ctx.save_for_backward(tape)  # freed after the backward, as torch frees what an op saved
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(o for o in outs if not (o.dtype.is_floating_point or o.dtype.is_complex)))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: MeshTensor | None) -> tuple[MeshTensor | None, ...]:
        (tape,) = ctx.saved_tensors
        got = iter(ctx.call.backward(tape, ctx.inputs, grads))
        return (None, *(next(got) if wanted else None for wanted in ctx.wanted))


def cotangent(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Where an output's gradient goes: a replicated output counts once (Partial: one rank of the dim
    holds it), each piece of a Partial one gets all of it (Replicate)."""
    return tuple(Replicate() if p.is_partial() else Partial() if isinstance(p, Replicate) else p
                 for p in placements)


def gradient(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """An input's gradient: each rank's contribution to the piece it was given."""
    return tuple(p if isinstance(p, Shard) else Partial() for p in placements)


def grad_spec(spec: Spec, placements: PlacementsLike, what: str) -> Spec:
    """`spec` placed as a gradient's `placements`, which must give each rank a piece of the same shape."""
    ps = normalize(placements, spec.mesh.labels, spec.ndim, what)
    out = spec.with_placements(ps)
    if any(out.local_shape(c) != spec.local_shape(c) for c in spec.mesh.coords()):
        raise ShardingError(f"{what}: {list(ps)} for a tensor placed {list(spec.placements)} gives pieces of other "
                            "shapes; give gradient placements that shard the same dims the same way")
    return out


def _specs(fn: Callable[..., Any], args: list[Any], outs: list[PlacementsLike], s: Session) -> tuple[Spec, ...]:
    """Global output specs, from running fn on meta tensors of every rank's local shapes."""
    per_rank = []
    for coords in s.abstract.coords():
        metas = [torch.empty(a._spec.local_shape(coords), dtype=a.dtype, device="meta") if isinstance(a, MeshTensor)
                 else a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
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
