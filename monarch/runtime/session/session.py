"""The controller-side backend of MeshTensors on one mesh view: record, flush, fetch.

A Session owns the view's tracer and a runner, chosen at construction. Flushing closes the pending
graph, partitions it and hands the rank programs to the runner: `RemoteRunner` lowers them and sends
every worker its program in one frame (a synchronising flush also collects one reply per rank: a
piece of the fetched tensor from the ranks holding distinct pieces, errors from any), a LocalMesh's
runner steps them in this process. Errors are raised in rank order.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import torch

from monarch import config
from monarch.errors import TraceError, TransportError
from monarch.graph.decompose import Decomposition, decomposition
from monarch.graph.partition import FREE_BATCH, partition
from monarch.graph.rules.factory import LIKE, NEW, RANDOM_LIKE
from monarch.graph.rules.table import Emit, writes_first_arg
from monarch.graph.trace import PlainTensor, TracedGraph, Tracer, rebind
from monarch.program.instr import Buf, Comm, Local, Start
from monarch.program.program import RankProgram
from monarch.runtime.control import codec
from monarch.runtime.control.commands import InvokeProgram
from monarch.runtime.control.controller import controller
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.control.futures import CallState, Future, Waiter
from monarch.runtime.session import crossmesh
from monarch.runtime.session.crossmesh import PlacementsArg
from monarch.runtime.session.lower import lower, lower_install
from monarch.shape import MeshLike
from monarch.tensor.data_dependent import whole
from monarch.tensor.device import MetaHandle, no_data
from monarch.tensor.meshtensor import MeshTensor, _tensor_args
from monarch.tensor.placement import Placement, Replicate, Shard
from monarch.tensor.spec import Spec, spec_of


class Runner(Protocol):
    """Where a session's rank programs run: on the workers of a proc mesh (RemoteRunner), or stepped in
    lockstep in this process (local.LockstepRunner). A Future of a synchronising run waits on `waiter`."""

    @property
    def live(self) -> bool: ...

    @property
    def waiter(self) -> Waiter: ...

    def run(self, programs: tuple[RankProgram, ...], fetch: Fetch | None, sync: bool) -> CallState | None:
        """Run one program per rank; with `sync`, the state that collects one reply per rank."""

    def invoke(self, call: InvokeProgram, install: tuple[RankProgram, ...] | None) -> None:
        """Run compiled program `call.pid`, installing `install` as that program first when given."""


class Session:
    """Backend of the MeshTensors of one mesh view; `runner` runs what it records."""

    def __init__(self, procs: MeshLike, runner: Runner, ids: Iterator[int] | None = None) -> None:
        self.mesh = procs
        self.runner = runner
        self.view = procs.mesh_shape
        self.abstract = self.view.extent
        self.tracer = Tracer(self.abstract, self, ids)
        self.flushes = 0
        self.collectives: list[str] = []  # kind[dim] of every collective shipped, in order
        self.flush_ops = config.flush_ops()
        self.capturing = False
        self.metas = 0  # live meta MeshTensors (MetaHandle counts them)
        _all.add(self)
        self._programs: dict[int, list[str]] = {}  # installed program id -> its collectives
        self._forgotten: list[int] = []  # programs dropped here, uninstalled by the workers with the next call

    @property
    def live(self) -> bool:
        """Whether the mesh still runs (a LocalMesh always does)."""
        return self.runner.live

    # -- Backend: the stages of tensor/intercept.py -------------------------------------------
    def with_generator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op given the user's torch.Generator runs here, on the fetched inputs, with that generator: its
        numbers and the generator's state are plain torch's. The result is replicated; an in-place op (whose
        target's values are never read) fills a blank tensor of the target's layout and copies it in."""
        if self.capturing:
            raise TraceError(f"{func.name()} with generator= inside a monarch.compile'd step would draw once, "
                             "while the step is recorded; draw outside the step and pass the tensor in, or drop "
                             "generator= to draw from monarch.manual_seed's stream")
        if not writes_first_arg(func):
            return self.tracer.constants(func(*whole(args), **whole(kwargs)))
        target = args[0]
        blank = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device="cpu")
        return target.copy_(func(blank, *whole(args[1:]), **whole(kwargs)))

    def decomposition(self, func: Any) -> Decomposition | None:
        return decomposition(func)

    def on_values(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """bool(t), an op returning no tensor: a sync point, run on the fetched data."""
        self._sync_point(func.name())
        return func(*whole(args), **whole(kwargs))

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.metas and any(t.is_meta for t in _tensor_args(args, kwargs)):
            return self._on_meta(func, args, kwargs)
        out = self.tracer.record(func, args, kwargs)
        if self.tracer.n_ops >= self.flush_ops and not self.capturing:
            self.flush()
        return out

    def _on_meta(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op on meta MeshTensors, answered here: its outputs are meta MeshTensors placed as the sharding rules
        place them (nothing is recorded or shipped). One making real tensors from their shapes alone (the
        empty_like of `module.to_empty`, zeros_like, rand_like, new_*) makes them on the workers; any other
        reading of their data raises `no_data`."""
        ins: list[MeshTensor] = []
        try:
            entry = self.tracer.decided(func, args, kwargs, ins)
        except PlainTensor:
            raise no_data(f"{func.name()}: a plain tensor met a meta MeshTensor") from None
        outs = entry.decision.outs
        if all(spec.device == "meta" for spec in outs):
            if not all(t.is_meta for t in ins):  # copy_ of real data (a checkpoint) into a meta tensor: lost
                raise no_data(f"{func.name()} writes real data into {args[0]._spec!r}, where it would be lost")
            made = [self.meta(spec) for spec in outs]
            return rebind(args[0], made[0]) if entry.inplace else entry.build(made)
        if func not in SHAPES_ONLY:
            raise no_data(f"{func.name()} reads the data of {', '.join(repr(t._spec) for t in ins if t.is_meta)}")
        if func in ZEROS:
            return self.materialise(outs[0])
        x = self.materialise(replace(args[0]._spec, device=outs[0].device))
        return self.record(func, (x, *args[1:]), kwargs)

    def meta(self, spec: Spec) -> MeshTensor:
        """A meta MeshTensor of `spec` (device "meta"): no buffer anywhere."""
        return MeshTensor(spec, self, MetaHandle(self, spec))

    def materialise(self, spec: Spec) -> MeshTensor:
        """Zeros placed as `spec`, each rank's piece made on its worker (monarch's empty is zero-filled)."""
        kw = {"dtype": spec.dtype, **({} if spec.device == "cpu" else {"device": torch.device(spec.device)})}
        node, ids = self.tracer.node(_target("aten::zeros"), (), (spec,), lambda ctx: [
            Local("aten::zeros", (list(spec.local_shape(ctx.coords)),), kw, ctx.out_ids)])
        return self.tracer.wrap(spec, node, ids[0])

    def redistribute(self, t: MeshTensor, placements: tuple[Placement, ...]) -> MeshTensor:
        if placements == t._spec.placements:
            return t
        if t.is_meta:  # no data to move
            return self.meta(t._spec.with_placements(placements))
        node, id = self.tracer.moved(t, t._spec.with_placements(placements))
        return self.tracer.wrap(node.meta["specs"][0], node, id)

    def to_mesh(self, t: MeshTensor, mesh: MeshLike, placements: PlacementsArg) -> MeshTensor:
        other = session_of(mesh)
        if self.capturing and other is not self and not _apart(self.mesh, mesh):
            raise TraceError(f"to_mesh from {self.mesh!r} to {mesh!r} inside a monarch.compile'd step needs two meshes "
                             "of proc meshes with no process in common (each mesh's program waits for the other's "
                             "piece); call it outside the step, or use disjoint meshes (e.g. procs.slice(stage=0) "
                             "and procs.slice(stage=1))")
        return crossmesh.to_mesh(self, other, t, placements)

    def fetch(self, t: MeshTensor) -> Future[torch.Tensor]:
        """Partial dims are reduced on the workers; each distinct shard then comes to the controller."""
        src = self.redistribute(t, tuple(Replicate() if p.is_partial() else p for p in t._spec.placements))
        future = self.flush(Fetch.of(src), sync=True)
        assert future is not None
        return future

    def on_ranks(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple], ins: Sequence[MeshTensor] = (),
                 specs: Sequence[Spec | None] = (None,)) -> list[MeshTensor]:
        """Kernel `op` on every rank, called with `args_of(rank index, coords)` and then the rank's pieces of
        `ins`; it returns one result per spec: a piece placed as the spec, or (None) any picklable value,
        held by the returned handle until `values` fetches it."""
        self._sync_point(f"{op} (a checkpoint step)")
        return self.record_on_ranks(op, args_of, ins, specs)

    def record_on_ranks(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple],
                        ins: Sequence[MeshTensor] = (), specs: Sequence[Spec | None] = (None,)) -> list[MeshTensor]:
        """`on_ranks`, also while a compiled step is recorded (its results are not read on the controller)."""
        srcs = [self.tracer.moved(t, t._spec) for t in ins]
        bufs = tuple(Buf(i) for _, i in srcs)
        index = {c: n for n, c in enumerate(self.abstract.coords())}
        value = self.value_spec()
        out_specs = tuple(value if spec is None else spec for spec in specs)

        def make(ctx: Emit) -> list[Local]:
            return [Local(op, (*args_of(index[ctx.coords], ctx.coords), *bufs), {}, ctx.out_ids)]
        node, ids = self.tracer.node(_target(op), tuple(n for n, _ in srcs), out_specs, make)
        return [self.tracer.wrap(spec, node, i) for spec, i in zip(out_specs, ids, strict=True)]

    def run_aside(self, op: str, args_of: Callable[[int, tuple[int, ...]], tuple]) -> list[Any]:
        """Kernel `op` on every rank now, outside the graph (also while a compiled step is recorded: its
        setup), called with `args_of(rank index, coords)`; each rank's value, in rank order."""
        id = next(self.tracer.ids)
        programs = tuple(RankProgram(c, (Local(op, args_of(i, c), {}, (id,)),))
                         for i, c in enumerate(self.abstract.coords()))
        fetch = Values(id, self.value_spec(), tuple(range(len(programs))))
        state = self.runner.run(programs, fetch, True)
        assert state is not None
        values = Future(state, self.runner.waiter, fetch.assemble).get()
        self.tracer.released.append(id)
        return values

    def value_spec(self) -> Spec:
        """The spec of a buffer holding any Python value on each rank (a kernel's result, never fetched as
        a tensor)."""
        return spec_of(torch.empty((), dtype=torch.uint8, device="meta"), (Replicate(),) * len(self.abstract),
                       self.abstract)

    def adopt(self, target: MeshTensor, source: MeshTensor) -> bool:
        """Let `target` name `source`'s buffer from now on, as a load that replaces all of its values does,
        without a copy: when their specs match and no view shares target's storage. Whether it did."""
        if target._spec != source._spec or target._handle.aliased() or source._handle.aliased():
            return False
        self.rebind(target, source)
        return True

    def rebind(self, target: MeshTensor, source: MeshTensor) -> None:
        target._spec, target._handle = source._spec, source._handle
        self.tracer.epoch += 1  # a compiled step's settled buffers are stale now

    def place(self, t: torch.Tensor, placements: tuple[Placement, ...] | None) -> MeshTensor:
        replicated = self.tracer.constants(t.detach())
        return replicated if placements is None else self.redistribute(replicated, placements)

    def values(self, handle: MeshTensor) -> Future[list[Any]]:
        """Every rank's value of an `on_ranks` result, in rank order (a sync point)."""
        future = self.flush(Values(handle._handle.id, handle._spec, tuple(range(len(self.view)))), sync=True)
        assert future is not None
        return future

    # -- shipping --------------------------------------------------------------------------------
    def _sync_point(self, what: str) -> None:
        if self.capturing:
            raise TraceError(f"{what} inside a monarch.compile'd step needs tensor values, which a compiled step "
                             "does not have while it is recorded; move it out of the step (return the tensor and "
                             "read it after the call), or call monarch.synchronize() outside the step")

    def flush(self, fetch: Fetch | None = None, sync: bool = False) -> Future[Any] | None:
        """Ship the pending graph; with `sync`, a Future of the fetched tensor (None without `fetch`)."""
        self._sync_point("reading a tensor (item, full_tensor, print, fetch, synchronize)")
        traced = self.tracer.take()
        return self.ship(traced, partition(traced, FREE_BATCH), fetch, sync)

    def ship(self, traced: TracedGraph, programs: tuple[RankProgram, ...], fetch: Fetch | None = None,
             sync: bool = False) -> Future[Any] | None:
        self.collectives.extend(self._comm_names(programs))
        self.flushes += 1
        state = self.runner.run(programs, fetch, sync)
        if state is None:
            return None
        return Future(state, self.runner.waiter, fetch.assemble if fetch else _synced)

    def invoke(self, call: InvokeProgram, install: tuple[RankProgram, ...] | None = None) -> None:
        """Run compiled program `call.pid`, installing `install` as that program first when given; the
        programs `forget` named since the last call are uninstalled first."""
        comms = self._comm_names(install) if install is not None else self._programs[call.pid]
        self._programs[call.pid] = comms
        self.collectives.extend(comms)
        if self._forgotten:
            call, self._forgotten = replace(call, forget=tuple(self._forgotten)), []
        self.runner.invoke(call, install)

    def forget(self, pid: int) -> None:
        """Compiled program `pid` will not run again: the workers drop it with the next call."""
        if self._programs.pop(pid, None) is not None:
            self._forgotten.append(pid)

    def _comm_names(self, programs: tuple[RankProgram, ...]) -> list[str]:
        """`kind[dim]` of each collective the programs run, in order."""
        names = self.abstract.labels
        return [f"{i.kind}[{names[i.mdim]}]" for i in programs[0].instrs if isinstance(i, (Comm, Start))]

    def synchronize(self, timeout: float | None = None) -> None:
        future = self.flush(sync=True)
        assert future is not None
        future.get(timeout)


class RemoteRunner:
    """Runs a session's programs on the workers of a proc mesh view: lowered, one frame per worker."""

    def __init__(self, procs: ProcMesh) -> None:
        self.procs = procs
        self.view = procs.mesh_shape

    @property
    def live(self) -> bool:
        return self.procs.running

    @property
    def waiter(self) -> Waiter:
        return controller()

    def run(self, programs: tuple[RankProgram, ...], fetch: Fetch | None, sync: bool) -> CallState | None:
        ctl = controller()
        call_id = ctl.next_call_id() if sync else 0
        refused: list[TransportError] = []
        pieces = self._frames(programs, call_id, fetch, refused)
        state = CallState(self.view, f"tensor program on {self.procs!r}") if sync else None
        for frames in pieces[:-1]:
            ctl.send_each(self.procs.mesh_id, frames, 0, None)
        ctl.send_each(self.procs.mesh_id, pieces[-1], call_id, state)
        if refused:
            raise refused[0]
        return state

    def _frames(self, programs: tuple[RankProgram, ...], call_id: int, fetch: Fetch | None,
                refused: list[TransportError]) -> list[dict[int, bytes]]:
        """Each rank's frame, or, when one is over MONARCH_MAX_FRAME, the programs cut into consecutive
        pieces that fit (the last one replies). An instruction too large alone (a constant's data) is not
        sent: it poisons its outputs with the error, which `refused` gets too."""
        limit = self.procs.max_frame
        msgs = lower(programs, self.view, call_id, fetch.sources() if fetch else None)
        frames = {r: codec.encode_frame([m]) for r, m in msgs.items()}
        big = max(frames.values(), key=len)
        if codec.fits(big, limit):
            return [frames]
        if len(programs[0].instrs) > 1:
            mid = len(programs[0].instrs) // 2
            return (self._frames(_cut(programs, 0, mid), 0, None, refused)
                    + self._frames(_cut(programs, mid, None), call_id, fetch, refused))
        ins = programs[0].instrs[0]
        assert isinstance(ins, Local), f"{ins!r} alone is over MONARCH_MAX_FRAME={limit}"
        refused.append(codec.too_large(f"the data of {ins.op} (a tensor of this program for one rank)", big, limit))
        refusal = Local("monarch::refused", (str(refused[-1]),), {}, ins.outs)
        return self._frames(tuple(replace(p, instrs=(refusal,)) for p in programs), call_id, fetch, refused)

    def invoke(self, call: InvokeProgram, install: tuple[RankProgram, ...] | None) -> None:
        """One frame per worker: the same bytes for every worker once the program is installed."""
        ranks = self.view.ranks()
        if install is None:
            frames = dict.fromkeys(ranks, codec.encode_frame([call]))
        else:
            installs = lower_install(call.pid, install, self.view)
            frames = {r: codec.encode_frame([installs[r], call]) for r in ranks}
        controller().send_each(self.procs.mesh_id, frames, 0, None,
                               "a call of a monarch.compile'd step (its program or plain tensor arguments)")


SHAPES_ONLY = frozenset((*LIKE, *NEW, *RANDOM_LIKE))  # ops reading only their first argument's shape
ZEROS = frozenset((torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default))  # monarch's empty: zeros


def _apart(a: MeshLike, b: MeshLike) -> bool:
    """Whether two meshes are views of proc meshes that share no worker process."""
    if not isinstance(a, ProcMesh) or not isinstance(b, ProcMesh):
        return False
    return a.mesh_id != b.mesh_id or not set(a.mesh_shape.ranks()) & set(b.mesh_shape.ranks())


def _cut(programs: tuple[RankProgram, ...], start: int, stop: int | None) -> tuple[RankProgram, ...]:
    """Instructions start..stop of every rank program (run one after the other, they do what all of it does)."""
    return tuple(replace(p, instrs=p.instrs[start:stop]) for p in programs)


@functools.cache
def _target(op: str) -> Callable[..., Any]:
    """The graph node target standing for worker kernel `op` (run only by the workers)."""
    def kernel(*args: Any) -> Any:
        raise AssertionError(f"{op} runs on the workers only")
    kernel.__name__ = kernel.__qualname__ = op.replace("::", "_")
    return kernel


def _synced(state: CallState) -> None:
    """Raise the error of the lowest failing rank, if any."""
    for i in range(len(state.raw)):
        state.value(i)


@dataclass(frozen=True)
class Fetch:
    """Buffer `id` comes to the controller: one rank per distinct piece sends it, then they are joined."""
    id: int
    spec: Spec
    holders: tuple[int, ...]  # row-major indices of the ranks that send a piece

    @staticmethod
    def of(t: MeshTensor) -> Fetch:
        spec = t._spec
        kept = [d for d, p in enumerate(spec.placements) if not isinstance(p, Shard)]
        holders = tuple(i for i, c in enumerate(spec.mesh.coords()) if all(c[d] == 0 for d in kept))
        return Fetch(t._handle.id, spec, holders)

    def sources(self) -> dict[int, int]:
        return dict.fromkeys(self.holders, self.id)

    def assemble(self, state: CallState) -> torch.Tensor:
        values = [state.value(i) for i in range(len(state.raw))]
        if len(self.holders) == 1:
            return values[self.holders[0]]
        out = torch.empty(self.spec.shape, dtype=self.spec.dtype, device="cpu")  # plain, also inside activate()
        coords = list(self.spec.mesh.coords())
        for i in self.holders:
            out[tuple(slice(s, s + n) for s, n in self.spec.bounds(coords[i]))] = values[i]
        return out


@dataclass(frozen=True)
class Values(Fetch):
    """Every rank sends its value of buffer `id`, as it is (a kernel's Python result)."""

    def assemble(self, state: CallState) -> list[Any]:
        return [state.value(i) for i in range(len(state.raw))]


_sessions: weakref.WeakValueDictionary[tuple[int, Any], Session] = weakref.WeakValueDictionary()
_buffer_ids: dict[int, Iterator[int]] = {}
_all: weakref.WeakSet[Session] = weakref.WeakSet()
NEW_SESSIONS: list[Callable[[Session], None]] = []  # told of each session made (a compiled step's recording)


def all_sessions() -> list[Session]:
    """Every live Session (proc mesh views and LocalMeshes)."""
    return list(_all)


class OwnsSession(Protocol):
    """A mesh simulated in this process (local.LocalMesh): it holds the Session of its one view."""

    @property
    def session(self) -> Session: ...


def session_of(procs: MeshLike) -> Session:
    """The Session of a ProcMesh view (one per view), or of a LocalMesh."""
    if not isinstance(procs, ProcMesh):
        return cast(OwnsSession, procs).session
    key = (procs.mesh_id, procs.mesh_shape)
    s = _sessions.get(key)
    if s is None:  # every view of a proc mesh numbers its buffers from one counter: its workers share one store
        ids = _buffer_ids.setdefault(procs.mesh_id, itertools.count(1))
        s = _sessions[key] = Session(procs, RemoteRunner(procs), ids)
        procs.keep_while_held(s)
        for join in NEW_SESSIONS:
            join(s)
    return s
