"""Recording: every op on MeshTensors becomes a node of a pending torch.fx graph, with specs decided.

For each call the tracer computes output shapes on meta tensors (never real data), asks propagation
for placements, inserts a redistribution node for every input whose placement must change, and hands
back new MeshTensors. Both results are cached by op and input signature, so a repeated op costs a
dictionary lookup. `take()` closes the pending graph as a frozen `TracedGraph` for partitioning.
"""
from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._mode_utils import no_dispatch

from monarch.errors import ShapeError, UnsupportedOpError
from monarch.graph.propagate import Decision, decide
from monarch.graph.redistribute import Plan, emit_step, plan
from monarch.graph.rules.table import Emit, OpCall, writes_first_arg
from monarch.graph.rules.view import COPYING_VIEWS
from monarch.program.instr import Buf, Instr, Local
from monarch.shape import Extent
from monarch.tensor.device import plain_device, result_device, without_index
from monarch.tensor.meshtensor import Backend, MeshTensor
from monarch.tensor.placement import Placements, Replicate
from monarch.tensor.random import next_seed
from monarch.tensor.spec import Spec, spec_of

SCALARS = (int, float, bool, complex)
PLAIN = (str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
NodeEmitter = Callable[[Emit], Sequence[Instr]]


class Value:
    """The handle a MeshTensor holds: its buffer id and the node that produces it.

    `copied_view` marks a view of a copy (its base was redistributed first, or `COPYING_VIEWS`): a write
    through it would not reach the base, and in-place ops on it are refused. `aliases` holds the live
    handles whose buffers share this one's storage on the workers (a base and its views).
    """
    __slots__ = ("id", "node", "tracer", "copied_view", "aliases", "__weakref__")

    def __init__(self, id: int, node: fx.Node, tracer: Tracer) -> None:
        self.id, self.node, self.tracer = id, node, tracer
        self.copied_view = False
        self.aliases: weakref.WeakSet[Value] | None = None

    def share(self, other: Value) -> None:
        """`other`'s buffer is this one's storage (a view of it, or an in-place op's result on it)."""
        if self.aliases is None:
            self.aliases = weakref.WeakSet([self])
        self.aliases.add(other)
        other.aliases = self.aliases

    def aliased(self) -> bool:
        """Whether another live handle shares this buffer's storage."""
        return self.aliases is not None and len(self.aliases) > 1

    def __del__(self) -> None:
        self.tracer.release(self.id)


@dataclass(frozen=True)
class Recorded:
    """What the tracer remembers about one op signature."""
    call: OpCall
    decision: Decision
    build: Callable[[list[Any]], Any]  # the op's return value from its output MeshTensors
    inplace: bool
    seeded: bool  # a random op: it draws a seed from monarch.manual_seed's stream
    view: bool    # the output aliases the first input


@dataclass
class Capture:
    """What tracing a compiled step notes besides the graph: the objects that feed it and receive it."""
    touched: list[weakref.ref] = field(default_factory=list)  # MeshTensors created or rebound meanwhile
    sources: dict[int, weakref.ref] = field(default_factory=dict)  # placeholder id -> MeshTensor read
    salt: fx.Node | None = None  # the feed of the per-call salt of the step's random ops, if it has any
    draws: Iterator[int] = field(default_factory=itertools.count)  # numbers the step's random ops
    on_input: Callable[[MeshTensor], None] | None = None  # told of each MeshTensor read from outside the step


@dataclass(frozen=True)
class TracedGraph:
    """A closed pending graph: fx nodes carry `ids`, `specs`, `emit` and `local_args` in their meta."""
    graph: fx.Graph
    mesh: Extent
    live: frozenset[int]      # buffers still held by MeshTensors after this graph
    released: tuple[int, ...]  # buffers produced earlier whose MeshTensors are gone

    def __str__(self) -> str:
        lines = []
        for n in self.graph.nodes:
            if n.op == "placeholder" or n.target is operator.getitem:
                continue
            ins = ", ".join(f"%{a.meta['ids'][0]}: {_placements(a)}" for a in n.all_input_nodes)
            outs = ", ".join(f"%{i}" for i in n.meta["ids"])
            specs = ", ".join(repr(s) for s in n.meta["specs"])
            lines.append(f"{outs} = {_target_name(n.target)}({ins}) -> {specs}")
        return "\n".join(lines)


_META = torch.device("meta")  # output shapes are computed on meta tensors, whatever device an op names
_EXTERNAL = fx.Graph().placeholder("external")  # the producer of buffers made by compiled programs


class Tracer:
    """The pending graph of one mesh view."""

    def __init__(self, mesh: Extent, backend: Backend, ids: Iterator[int] | None = None) -> None:
        self.mesh, self.backend = mesh, backend
        self.ids = itertools.count(1) if ids is None else ids  # buffer ids: shared by the views of one store
        self.live: dict[int, int] = {}  # buffer id -> how many Values name it (a cached redistribution is shared)
        self.released: list[int] = []
        self.cache: dict[Any, Recorded] = {}
        self.epoch = 0  # counts recorded nodes and flushes: unchanged means no MeshTensor was rebound
        self.capture: Capture | None = None
        self._new_graph()

    def _new_graph(self) -> None:
        self.graph = fx.Graph()
        self.n_ops = 0
        self._inputs: dict[int, fx.Node] = {}      # buffer id -> placeholder of an earlier buffer
        self._moved_cache: dict[tuple[int, Placements], tuple[fx.Node, int]] = {}

    # -- values ----------------------------------------------------------------------------------
    def new_value(self, node: fx.Node, id: int | None = None) -> Value:
        v = Value(next(self.ids) if id is None else id, node, self)
        self.live[v.id] = self.live.get(v.id, 0) + 1
        return v

    def release(self, id: int) -> None:
        n = self.live.pop(id, 1) - 1
        if n > 0:
            self.live[id] = n
        else:
            self.released.append(id)

    def wrap(self, spec: Spec, node: fx.Node, id: int) -> MeshTensor:
        t = MeshTensor(spec, self.backend, self.new_value(node, id))
        if self.capture is not None:
            self.capture.touched.append(weakref.ref(t))
        return t

    def external(self, id: int) -> Value:
        """A handle for a buffer a compiled program produced outside the pending graph."""
        return self.new_value(_EXTERNAL, id)

    def _node_of(self, t: MeshTensor) -> fx.Node:
        v: Value = t._handle
        if v.node.graph is self.graph:
            return v.node
        node = self._inputs.get(v.id)
        if node is None:
            node = self.graph.create_node("placeholder", f"b{v.id}", name=f"b{v.id}")
            node.meta.update(ids=(v.id,), specs=(t._spec,), emit=None)
            self._inputs[v.id] = node
            if self.capture is not None:
                self.capture.sources[v.id] = weakref.ref(t)
                if self.capture.on_input is not None:
                    self.capture.on_input(t)
        return node

    # -- recording -------------------------------------------------------------------------------
    def node(self, target: Any, args: tuple, specs: tuple[Spec, ...], emit: NodeEmitter | None,
             local_args: tuple = (), local_kwargs: dict | None = None, call: OpCall | None = None,
             in_specs: tuple[Spec, ...] = ()) -> tuple[fx.Node, tuple[int, ...]]:
        """Append one node producing len(specs) new buffers; `emit` makes its per-rank instructions."""
        ids = (next(self.ids),) if len(specs) == 1 else tuple(next(self.ids) for _ in specs)
        n = self.graph.create_node("call_function", target, (), {}, name=f"n{ids[0] if ids else next(self.ids)}")
        n._update_args_kwargs(args, {})
        n.meta.update(ids=ids, specs=specs, emit=emit, local_args=local_args, local_kwargs=local_kwargs or {},
                      call=call, in_specs=in_specs)
        self.n_ops += 1
        self.epoch += 1
        return n, ids

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """One aten op as a node of the pending graph: decide its specs (cached by signature), move the inputs
        to the placements decided, append the node, and hand back its outputs as MeshTensors."""
        ins: list[MeshTensor] = []
        try:
            entry = self.decided(func, args, kwargs, ins)
        except PlainTensor:
            return self.record(func, *self.constants((args, kwargs)))
        if entry.inplace:
            _check_aliased_write(func, ins[0], entry.decision.ins[0])
        srcs = [self.moved(t, want) for t, want in zip(ins, entry.decision.ins, strict=True)]
        outs = self._append(func, args, kwargs, entry, srcs)
        if entry.inplace:
            return self._write_in_place(func, args[0], srcs[0][1], outs[0])
        if entry.view and ins:
            _share_or_copy_view(func, ins[0], srcs[0][1], outs)
        return entry.build(outs)

    def decided(self, func: Any, args: tuple, kwargs: dict, ins: list[MeshTensor]) -> Recorded:
        """What the op's signature records (cached); collects its MeshTensor arguments into `ins`."""
        try:
            key = (func, _key(args, ins), _key(kwargs, ins) if kwargs else None)
            entry = self.cache.get(key)
        except TypeError:  # an unhashable argument: analyse without caching
            key, entry = None, None
        if entry is None:
            entry = self._analyze(func, args, kwargs, ins)
            if key is not None:
                self.cache[key] = entry
        return entry

    def _append(self, func: Any, args: tuple, kwargs: dict, entry: Recorded,
                srcs: list[tuple[fx.Node, int]]) -> list[MeshTensor]:
        """The op's node, reading the buffers `srcs` (the inputs as placed for it); its outputs."""
        bufs, d = iter([Buf(i) for _, i in srcs]), entry.decision
        node, ids = self.node(func, tuple(n for n, _ in srcs), d.outs, d.emit or Emit.default, _substitute(args, bufs),
                              _substitute(without_index(kwargs), bufs) if kwargs else {}, entry.call, d.ins)
        if entry.seeded:
            self.seeded(node)
        return [self.wrap(spec, node, i) for spec, i in zip(d.outs, ids, strict=True)]

    def _write_in_place(self, func: Any, target: MeshTensor, read: int, out: MeshTensor) -> MeshTensor:
        """An in-place op whose node read buffer `read` for `target`: `target` names `out` from now on."""
        reshaped = torch.Tag.inplace_view in func.tags  # squeeze_, t_: the target's shape changes, no data
        out._handle.copied_view = reshaped and target._handle.copied_view
        if target._handle.copied_view and not reshaped:
            raise UnsupportedOpError(
                f"{func.name()}: writing through a view whose base MeshTensor had to be redistributed "
                f"(now {target._spec}) would not reach the base; redistribute the base first so the view "
                "needs no data movement (e.g. to Replicate on the viewed dims), or use an out-of-place op")
        if read == target._handle.id:
            target._handle.share(out._handle)
        if self.capture is not None:
            self.capture.touched.append(weakref.ref(target))
        return rebind(target, out)

    def seeded(self, node: fx.Node) -> None:
        """Give random op `node` its seed (`Emit.seed`), the next of monarch.manual_seed's stream. In a
        compiled step the seed is (the op's number in the step, salt buffer): each call feeds the next of
        the stream as the salt, so that every call draws new numbers, and the numbers do not depend on
        whether the call recorded the step; the salt's feed node becomes an input of `node`."""
        cap = self.capture
        if cap is None:
            node.meta["seed"] = next_seed()
            return
        if cap.salt is None:
            spec = spec_of(torch.empty((), dtype=torch.int64, device=_META), (Replicate(),) * len(self.mesh), self.mesh)
            cap.salt, _ = self.node(feed, (), (spec,), _no_instructions)
            node.prepend(cap.salt)
        node._update_args_kwargs((*node.args, cap.salt), {})
        node.meta["seed"] = (next(cap.draws), Buf(cap.salt.meta["ids"][0]))

    def constants(self, obj: Any) -> Any:
        """`obj` with every plain tensor replaced by a replicated MeshTensor of its data (sent to each rank)."""
        t = type(obj)
        if t is tuple or t is list:
            return t(self.constants(o) for o in obj)
        if t is dict:
            return {k: self.constants(v) for k, v in obj.items()}
        if isinstance(obj, torch.Tensor) and t is not MeshTensor:
            data, on = obj.detach().cpu().clone(), plain_device(obj, self.backend.mesh.device)
            spec = spec_of(data, (Replicate(),) * len(self.mesh), self.mesh, on)
            node, ids = self.node(constant, (), (spec,),
                                  lambda ctx: [Local("monarch::constant", (data, spec.device), {}, ctx.out_ids)])
            return self.wrap(spec, node, ids[0])
        return obj

    def feed(self, spec: Spec, slot: Any) -> MeshTensor:
        """A compiled step's plain tensor argument `slot` (or what getter `slot` returns), placed as `spec`:
        each call sends its data."""
        node, ids = self.node(feed, (), (spec,), _no_instructions)
        node.meta["feed"] = slot
        return self.wrap(spec, node, ids[0])

    def moved(self, t: MeshTensor, want: Spec) -> tuple[fx.Node, int]:
        """The node and buffer holding `t` with `want`'s placements (redistributed when they differ)."""
        src, v = self._node_of(t), t._handle
        if t._spec.placements == want.placements:
            return src, v.id
        key = (v.id, want.placements)
        hit = self._moved_cache.get(key)
        if hit is None:
            p = plan(t._spec, want.placements)
            node, ids = self.node(redistribute, (src,), (p.dst,), _plan_emitter(p), (Buf(v.id),))
            hit = self._moved_cache[key] = (node, ids[0])
        return hit

    def _analyze(self, func: Any, args: tuple, kwargs: dict, ins: list[MeshTensor]) -> Recorded:
        metas = iter([t._spec.meta() for t in ins])
        try:
            meta_kwargs = {k: _META if isinstance(v, torch.device) else v for k, v in kwargs.items()}
            result = func(*_substitute(args, metas), **_substitute(meta_kwargs, metas))
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            specs = ", ".join(repr(t._spec) for t in ins)
            raise ShapeError(f"{func.name()}: {e} (inputs: {specs}); plain torch rejects the same global "
                             "shapes, fix the shapes or dims of the inputs") from None
        flat, build = _structure(func, result)
        R = (Replicate(),) * len(self.mesh)
        device = result_device(func.name(), args, kwargs, [t._spec for t in ins], self.backend.mesh.device)
        outs = tuple(spec_of(m, R, self.mesh, device) for m in flat)
        placed = iter([t._spec for t in ins])
        call = OpCall(func, _substitute(args, placed), _substitute(kwargs, placed) if kwargs else {},
                      tuple(t._spec for t in ins), outs)
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        return Recorded(call, decide(call), build, writes_first_arg(func),
                        torch.Tag.nondeterministic_seeded in func.tags, view)

    def take_released(self) -> tuple[int, ...]:
        """Buffers released since the last flush, when nothing else is pending (they are freed at once)."""
        assert not self.n_ops, "take_released with pending ops; flush first"
        released, self.released = tuple(self.released), []
        return released

    def take(self) -> TracedGraph:
        """Close the pending graph and start a new one."""
        released, self.released = tuple(self.released), []
        self.epoch += 1
        traced = TracedGraph(self.graph, self.mesh, frozenset(self.live), released)
        self._new_graph()
        return traced


class PlainTensor(Exception):
    """A plain torch.Tensor argument: it becomes a replicated constant first."""


def constant(x: Any) -> Any:
    """fx target of a node holding data shipped from the controller."""
    raise AssertionError("constant nodes are partitioned, never called")


def feed(x: Any) -> Any:
    """fx target of a node whose data each call of a compiled program brings."""
    raise AssertionError("feed nodes are partitioned, never called")


def _no_instructions(ctx: Emit) -> list[Instr]:
    return []


def redistribute(x: Any) -> Any:
    """fx target of a redistribution node (the plan is in the node's meta)."""
    raise AssertionError("redistribute nodes are partitioned, never called")


def _plan_emitter(p: Plan) -> NodeEmitter:
    def emit(ctx: Emit) -> list[Instr]:
        src, out = ctx.args[0].id, ctx.out_ids[0]
        instrs: list[Instr] = []
        for i, step in enumerate(p.steps):
            dst = out if i == len(p.steps) - 1 else ctx.fresh()
            instrs.append(emit_step(step, ctx.coords, src, dst))
            src = dst
        return instrs
    return emit


def _key(obj: Any, ins: list[MeshTensor]) -> Any:
    """A hashable signature of an argument; collects MeshTensors into `ins` in order."""
    t = type(obj)
    if t is MeshTensor:  # of this tracer's mesh: MeshTensor's dispatch refused tensors of two meshes
        ins.append(obj)
        return obj._spec
    if t in SCALARS:
        return (t, obj)
    if t is tuple or t is list:
        return (t, *(_key(o, ins) for o in obj))
    if t is dict:
        return tuple((k, _key(v, ins)) for k, v in obj.items())
    if t is torch.Tensor and obj.ndim == 0 and obj.device.type == "cpu":  # a scalar, e.g. from torch.where(c, x, 0.)
        return (t, obj.dtype, obj.item())
    if isinstance(obj, torch.Tensor):
        raise PlainTensor()
    if isinstance(obj, PLAIN):
        return obj
    raise TypeError(f"unhashable {t.__name__}")


def _substitute(obj: Any, values: Any) -> Any:
    """`obj` with each MeshTensor replaced by the next item of `values`."""
    t = type(obj)
    if t is MeshTensor:
        return next(values)
    if t is tuple or t is list:
        return t(_substitute(o, values) for o in obj)
    if t is dict:
        return {k: _substitute(v, values) for k, v in obj.items()}
    return obj


def _structure(func: Any, result: Any) -> tuple[list[torch.Tensor], Callable[[list[Any]], Any]]:
    """Flat tensor outputs and a function rebuilding the op's return value from MeshTensors."""
    if isinstance(result, torch.Tensor):
        return [result], operator.itemgetter(0)
    if isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result) and all(
            isinstance(r, torch.Tensor) or r is None for r in result):
        kind, n = type(result), len(result)
        where = [i for i, r in enumerate(result) if r is not None]  # None: an undefined grad

        def build(outs: list[Any]) -> Any:
            full: list[Any] = [None] * n
            for i, o in zip(where, outs, strict=True):
                full[i] = o
            return kind(full)
        return [result[i] for i in where], build
    raise UnsupportedOpError(f"{func.name()} returns {type(result).__name__}, not tensors; monarch cannot run it on "
                             "a MeshTensor yet; call .full_tensor() first")


def _check_aliased_write(func: Any, target: MeshTensor, want: Spec) -> None:
    """An in-place op that must redistribute its target writes into a copy: refused when a view or a base
    shares the target's data (they would not see the write). Shape-only in-place views are fine."""
    if target._handle.aliased() and target._spec.placements != want.placements \
            and torch.Tag.inplace_view not in func.tags:
        raise UnsupportedOpError(
            f"{func.name()}: its target {target._spec} shares its data with a view or a base, and the op needs "
            f"the target as {want}: the write would land in a copy that the others do not see; redistribute "
            "the base to that placement first, or use an out-of-place op")


def _share_or_copy_view(func: Any, base: MeshTensor, read: int, outs: list[MeshTensor]) -> None:
    """A view's outputs share `base`'s storage when it read `base`'s own buffer `read`; else (a redistributed
    base, a view of a copy, a copying view) they view a copy, and writes through them are refused."""
    if read != base._handle.id or base._handle.copied_view or func in COPYING_VIEWS:
        for o in outs:
            o._handle.copied_view = True
    else:
        for o in outs:
            base._handle.share(o._handle)


def rebind(target: MeshTensor, out: MeshTensor) -> MeshTensor:
    """An in-place op: `target` now names the op's result (new placements; `squeeze_`, `t_`: new shape too)."""
    target._spec, target._handle = out._spec, out._handle
    if target.shape != out.shape or target.stride() != out.stride():
        with no_dispatch():
            torch.Tensor.as_strided_(target, out.shape, out.stride())
    return target


def _placements(n: fx.Node) -> str:
    return ",".join(map(repr, n.meta["specs"][0].placements))


def _target_name(t: Any) -> str:
    return str(t.name()).removeprefix("aten::") if hasattr(t, "name") else getattr(t, "__name__", str(t))
