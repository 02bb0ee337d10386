"""`monarch.compile`: a training step traced once into one graph, installed on the workers, replayed.

A call with a new signature runs the step while recording it (a sync point inside raises TraceError),
partitions the whole graph once, installs one program per rank (installed.py) and runs it. Later calls
with the same signature send each worker one small message naming the program, the buffers it reads and
the ones it writes, and return new lazy MeshTensors. The signature covers the tensor arguments' shapes, dtypes and
placements and the Python scalars passed or named by the step's own code; each program's guards (guards.py)
cover the state its recording met: optimizers, modules, parameters' `.grad`. A change retraces (logged at
debug level with the reason). Scalars a helper function reads from its own closure or globals are baked in.
"""
from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from monarch import config
from monarch.errors import TraceError
from monarch.graph.partition import partition
from monarch.graph.schedule import overlap
from monarch.graph.trace import Capture
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.control.commands import InvokeProgram
from monarch.runtime.session import crossmesh
from monarch.runtime.session.guards import CONSTANTS, Watch, capturable_on_cpu, known_optimizers, make_capturable
from monarch.runtime.session.installed import FromArgument, FromGrad, FromState, Input, InstalledStep, Joint, Kept, \
    KeptGrad, feeds
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import NEW_SESSIONS, Session, all_sessions, session_of
from monarch.runtime.session.update import at_optimizer_steps
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Replicate
from monarch.tensor.spec import Spec, spec_of

log = logging.getLogger("monarch.compile")
_pids = itertools.count(1)
_LEAVES = (torch.Tensor, *CONSTANTS)


class CompiledStep:
    """The callable `monarch.compile` returns; `traces` counts how often it recorded the step."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.cache: dict[Any, list[InstalledStep | Joint]] = {}  # signature -> programs, newest last
        self.traces = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = list(args) if not kwargs and all(isinstance(a, _LEAVES) for a in args) else \
            pytree.tree_flatten((args, kwargs))[0]
        key = signature(flat, self.fn)
        programs = self.cache.setdefault(key, [])
        why: str | None = "first call with this signature"
        for program in reversed(list(programs)):
            why = program.guards.why_not()
            if why is None:
                fit = program.fit(flat)
                if fit.why is None:
                    return program.run(flat, fit)
                why = fit.why
                programs.remove(program)  # an input is gone or placed anew: it never fits again
                program.forget()
        log.debug("monarch.compile: tracing %s (%s)", _name(self.fn), why)
        reached = near(self.fn, flat)
        for opt in known_optimizers(reached):
            if isinstance(opt, torch.optim.Adam):
                make_capturable(opt)
        program, result = self._trace(args, kwargs, flat, home(reached))
        if program is not None:
            for old in programs[:len(programs) + 1 - _KEEP]:  # the oldest, beyond _KEEP: uninstalled
                old.forget()
            programs[:] = [*programs[1 - _KEEP:], program]
        return result

    def _trace(self, args: tuple, kwargs: dict, flat: list[Any], target: Session
               ) -> tuple[InstalledStep | Joint | None, Any]:
        """Run the step while recording. Plain tensor arguments enter as replicated MeshTensors that
        each call fills (the step's own code then shards them, e.g. data_parallel's input hook). A step that
        moves tensors to other meshes (to_mesh) records on each and installs one program per mesh. No
        program is kept when the step met an Adam whose step counts were still on the controller."""
        for s in all_sessions():  # what was recorded before runs first (also on proc meshes the step may reach)
            if s.tracer.n_ops and (s is target or isinstance(s.mesh, ProcMesh) and s.live):
                s.flush()
        fed = [target.tracer.feed(_replicated(t, target), i) if _plain(t) else t for i, t in enumerate(flat)]
        args, kwargs = pytree.tree_unflatten(fed, pytree.tree_flatten((args, kwargs))[1])
        watch = Watch(feed=functools.partial(_feed, target))
        crossmesh.STAGED.clear()
        with Recording(watch) as rec, capturable_on_cpu(), watch.hooks(), at_optimizer_steps():
            result = self.fn(*args, **kwargs)
        used, captures = rec.used(target), rec.captures
        returned, spec = pytree.tree_flatten(result)
        if not all(isinstance(t, MeshTensor) for t in returned):
            raise TraceError("a monarch.compile'd step may return only MeshTensors (or nested lists, tuples and "
                             "dicts of them); return plain values from outside the step")
        self.traces += 1
        if len(used) == 1:
            program: InstalledStep | Joint = install(used[0], captures[used[0]], returned, spec, flat, watch)
        else:  # each mesh's program returns a flat list of the results that live there
            mine = [[t for t in returned if t._backend is s] for s in used]
            program = Joint(tuple(install(s, captures[s], m, pytree.tree_flatten(m)[1], flat, watch)
                                  for s, m in zip(used, mine, strict=True)), _places(returned, used), spec,
                            tuple(crossmesh.STAGED))
        watch.refuse_changes(_name(self.fn))  # after the call ran: its MeshTensors are consistent
        for opt in watch.unconverted:
            make_capturable(opt)
        return (None if watch.unconverted else program), result


def _places(returned: list[MeshTensor], used: list[Session]) -> tuple[tuple[int, int], ...]:
    """For each returned tensor: the program (of `used`) that returns it, and its position among that
    program's results."""
    counts = [0] * len(used)
    places = []
    for t in returned:
        part = next(i for i, s in enumerate(used) if s is t._backend)
        places.append((part, counts[part]))
        counts[part] += 1
    return tuple(places)


class Recording:
    """The sessions that record one call of a step: every one that exists when it starts, and any made while it
    runs (a mesh the step reaches first inside itself, such as to_mesh's destination) as it is made."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.captures: dict[Session, Capture] = {}
        self.before: dict[Session, int] = {}

    def join(self, s: Session) -> None:
        self.captures[s], self.before[s] = Capture(on_input=self.watch.input), s.tracer.epoch
        s.capturing, s.tracer.capture = True, self.captures[s]

    def __enter__(self) -> Recording:
        for s in all_sessions():
            self.join(s)
        NEW_SESSIONS.append(self.join)
        return self

    def __exit__(self, *_: object) -> None:
        NEW_SESSIONS.remove(self.join)
        for s in self.captures:
            s.capturing, s.tracer.capture = False, None

    def used(self, target: Session) -> list[Session]:
        """The sessions the step recorded on (at least `target`)."""
        return [s for s in self.captures if s.tracer.epoch != self.before[s]] or [target]


_KEEP = 8  # programs kept per signature (one per state the step met: gradients set or not, hyperparameters)


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", fn))


def _feed(target: Session, get: Callable[[], torch.Tensor], near: torch.Tensor) -> MeshTensor:
    """A per-call scalar input of the step (an optimizer's hyperparameter), on the mesh of `near`, the
    parameter it meets (`target`'s when that is not a MeshTensor)."""
    s = near._backend if isinstance(near, MeshTensor) and isinstance(near._backend, Session) else target
    return s.tracer.feed(_scalar(s), get)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not MeshTensor


def _scalar(s: Session) -> Spec:
    return _replicated(torch.empty((), dtype=torch.float64, device="meta"), s)


def _replicated(t: torch.Tensor, s: Session) -> Spec:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return spec_of(meta, (Replicate(),) * len(s.abstract), s.abstract)


def home(near: list[Any]) -> Session:
    """The session a step computes on: that of the MeshTensors or meshes it reaches (arguments first),
    else of the parameters of the modules and optimizers it names, else the only mesh there is."""
    params = (p for obj in near for p in (obj.parameters() if isinstance(obj, torch.nn.Module) else
                                          (q for g in obj.param_groups for q in g["params"])
                                          if isinstance(obj, torch.optim.Optimizer) else ()))
    for t in itertools.chain(near, params):
        if isinstance(t, MeshTensor):
            assert isinstance(t._backend, Session)
            return t._backend
        if isinstance(t, (ProcMesh, LocalMesh)):
            return session_of(t)
    live = [s for s in all_sessions() if s.live]
    if len(live) == 1:
        return live[0]
    raise TraceError("monarch.compile cannot tell which mesh the step runs on: pass a MeshTensor argument, or "
                     "use modules or optimizers whose parameters are MeshTensors")


def install(s: Session, cap: Capture, returned: list[MeshTensor], spec: pytree.TreeSpec, flat: list[Any],
            watch: Watch) -> InstalledStep:
    """Close the graph recorded on `s`'s mesh, install it as a program and run it for this call; `returned`:
    the step's results that live there, put together as `spec` says."""
    traced = s.tracer.take()
    programs = partition(traced)
    if config.bucket_bytes() > 0:
        programs = overlap(programs, config.bucket_bytes())
    nodes = list(traced.graph.nodes)
    produced = {i for n in nodes if n.op != "placeholder" for i in n.meta["ids"]}
    slots = {t._handle.id: i for i, t in enumerate(flat) if isinstance(t, MeshTensor) and t._backend is s}
    arguments = {id(t) for t in flat}
    params = [p for p, _ in watch.grads.values() if id(p) not in arguments and p._backend is s]
    owners = {id(g): p for p, g in watch.grads.values() if g is not None and id(p) not in arguments}
    owners.update((id(p.grad), p) for p in params if p.grad is not None)
    inputs = tuple(_input(i, slots, cap.sources[i], n.meta["specs"][0], owners)
                   for n in nodes if n.op == "placeholder" for i in n.meta["ids"])
    outputs = kept(cap, params, produced, {id(t) for t in returned})
    for t in returned:
        if t._handle.id not in produced:
            raise TraceError("a monarch.compile'd step returned one of its inputs unchanged; return only "
                             "tensors the step computes")
    fed = tuple((n.meta["ids"][0], n.meta["feed"]) for n in nodes if "feed" in n.meta)
    salt = cap.salt.meta["ids"][0] if cap.salt is not None else None
    grads = any(isinstance(x, (FromGrad, KeptGrad)) for x in (*inputs, *outputs))
    program = InstalledStep(next(_pids), s, inputs, outputs, tuple((t._handle.id, t._spec) for t in returned),
                            fed, salt, spec, watch.guards(arguments), settles=not grads)
    same = tuple((i.id, i.id) for i in inputs)
    outs = tuple((k.id, k.id) for k in outputs) + tuple((i, i) for i, _ in program.returns)
    s.invoke(InvokeProgram(program.pid, same, outs, feeds(fed, flat, salt)), programs)
    # buffers released while tracing live outside the program's own namespace: free them after it ran
    s.tracer.released.extend(i for i in traced.released if i not in produced)
    return program


def kept(cap: Capture, params: list[MeshTensor], produced: set[int], returned: set[int]) -> tuple[Kept | KeptGrad, ...]:
    """The results the step leaves behind: the gradients of the parameters it read, then every other
    MeshTensor it made or rebound that is still alive and not returned."""
    out: list[Kept | KeptGrad] = []
    seen: set[int] = set()
    for p in params:
        g = p.grad
        if isinstance(g, MeshTensor) and g._handle.id in produced and id(g) not in returned:
            seen.add(g._handle.id)
            out.append(KeptGrad(g._handle.id, weakref.ref(p), g._spec))
    for ref in cap.touched:
        t = ref()
        if t is not None and id(t) not in returned and t._handle.id in produced and t._handle.id not in seen:
            seen.add(t._handle.id)
            out.append(Kept(t._handle.id, weakref.ref(t)))
    return tuple(out)


def _input(i: int, slots: dict[int, int], source: weakref.ref[MeshTensor], spec: Spec,
           owners: dict[int, MeshTensor]) -> Input:
    """Placeholder `i`: filled by an argument when one holds it, else through the parameter whose `.grad`
    it was read from, else by the MeshTensor it was read from. Its spec is the object that MeshTensor
    holds now when equal (later checks are identity tests)."""
    t = source()
    if t is not None and t._spec == spec:
        spec = t._spec
    if i in slots:
        return FromArgument(i, slots[i], spec)
    owner = owners.get(id(t))
    return FromState(i, source, spec) if owner is None else FromGrad(i, weakref.ref(owner), spec)


def signature(flat: list[Any], fn: Callable[..., Any]) -> tuple[Any, ...]:
    """What a cached program depends on besides the buffers it reads and the state its guards check:
    the arguments, and the Python scalars the step's own code reads from its closure and globals."""
    parts: list[Any] = []
    for a in flat:
        if isinstance(a, MeshTensor):
            parts.append(("mesh", a._spec, id(a._backend)))
        elif isinstance(a, torch.Tensor):
            parts.append(("tensor", tuple(a.shape), a.dtype))
        elif isinstance(a, CONSTANTS):
            parts.append((type(a), a))
        else:
            parts.append(("object", id(a)))
    parts.append(tuple((type(v), v) if isinstance(v, CONSTANTS) else None for v in _named(fn)))
    return tuple(parts)


def near(fn: Callable[..., Any], flat: list[Any]) -> list[Any]:
    """Where the step's mesh may be found: its arguments, closure cells and the globals it names."""
    return [*flat, *_named(fn)]


def _named(fn: Callable[..., Any]) -> list[Any]:
    """The step's closure cells, default arguments, the globals its code names, and the object of a bound
    method."""
    found = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
    found += [*(getattr(fn, "__defaults__", None) or ()), *(getattr(fn, "__kwdefaults__", None) or {}).values()]
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        found += [env[n] for n in code.co_names if n in env]
    if hasattr(fn, "__self__"):
        found.append(fn.__self__)
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def compile(fn: Callable[..., Any]) -> CompiledStep:  # noqa: A001 - the public name is monarch.compile
    """Trace `fn` once per signature into one program per rank; later calls replay it."""
    return CompiledStep(fn)
