"""`monarch.compile`: a training step traced once into one graph, installed on the workers, replayed.

A call with a new signature runs the step while recording it (a sync point inside raises TraceError),
partitions the whole graph once, installs one program per rank and runs it. Later calls with the same
signature send each worker one small message naming the program, the buffers it reads and the ones it
writes, and return new lazy MeshTensors. The signature covers the tensor arguments' shapes, dtypes and
placements, Python scalars, and the state of the optimizers and modules the step reaches; a change
retraces (logged at debug level with the reason).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.optim import adam as torch_adam

from monarch import config
from monarch.errors import TraceError
from monarch.graph.partition import partition
from monarch.graph.schedule import overlap
from monarch.graph.trace import SCALARS, Capture, Tracer
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.control.commands import InvokeProgram
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import Session, all_sessions, session_of
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Replicate
from monarch.tensor.random import next_seed
from monarch.tensor.spec import Spec, spec_of

log = logging.getLogger("monarch.compile")
_pids = itertools.count(1)
CONSTANTS = (*SCALARS, str, type(None))  # what a program is keyed by the value of
_LEAVES = (torch.Tensor, *CONSTANTS)


class FromArgument(NamedTuple):
    """A program input that each call fills with its MeshTensor argument `slot` (of the flattened arguments)."""
    id: int  # placeholder id
    slot: int
    spec: Spec

    def tensor(self, flat: list[Any]) -> MeshTensor | None:
        return flat[self.slot]


class FromState(NamedTuple):
    """A program input read from a MeshTensor the step reaches without being passed it (a parameter,
    optimizer state), held weakly: once it is gone the program no longer fits."""
    id: int  # placeholder id
    ref: weakref.ref[MeshTensor]
    spec: Spec

    def tensor(self, flat: list[Any]) -> MeshTensor | None:
        return self.ref()


Input = FromArgument | FromState


class Kept(NamedTuple):
    """A result the step leaves in a MeshTensor it does not return (updated parameters, optimizer state)."""
    id: int  # produced id
    ref: weakref.ref[MeshTensor]


@dataclass(frozen=True)
class Settled:
    """How calls bind after one that moved no handle: valid while nothing else was recorded (the
    tracer is still at `epoch`) and none of the buffers `reads` was released."""
    epoch: int
    reads: frozenset[int]                # buffer ids of the inputs that are not arguments
    held: tuple[tuple[int, int], ...]    # their (placeholder id, buffer id) pairs
    outputs: tuple[tuple[int, int], ...]  # (produced id, buffer id) of every kept result

    def valid(self, tracer: Tracer) -> bool:
        return self.epoch == tracer.epoch and self.reads.isdisjoint(tracer.released)


@dataclass
class Program:
    """One installed program and how a call binds to it."""
    pid: int
    session: Session
    inputs: tuple[Input, ...]
    outputs: tuple[Kept, ...]
    returns: tuple[tuple[int, Spec], ...]              # produced ids of the returned tensors, their specs
    feeds: tuple[tuple[int, int], ...]                 # feed id, argument slot (replicated)
    salt: int | None                                   # feed id of the random ops' per-call salt
    spec: pytree.TreeSpec                              # structure of the return value
    settled: Settled | None = None

    def stale(self, flat: list[Any]) -> str | tuple[tuple[int, int], ...]:
        """Why the program no longer fits its inputs, or (when it fits) the buffers this call reads."""
        settled = self.settled
        if settled is not None and settled.valid(self.session.tracer):
            return settled.held + self._check(flat, [i for i in self.inputs if isinstance(i, FromArgument)])
        self.settled = None
        return self._check(flat, self.inputs)

    def _check(self, flat: list[Any], which: Iterable[Input]) -> Any:
        inputs = []
        for i in which:
            t = i.tensor(flat)
            if t is None:
                return f"input buffer %{i.id} is gone"
            if t._spec is not i.spec and t._spec != i.spec:
                return f"input {i.spec} is now {t._spec}"
            inputs.append((i.id, t._handle.id))
        return tuple(inputs)

    def run(self, flat: list[Any], inputs: tuple[tuple[int, int], ...]) -> Any:
        s = self.session
        if s.tracer.n_ops:
            s.flush()  # work recorded between calls runs first
        settled = self.settled
        outputs, moved = self._outputs(s) if settled is None else (settled.outputs, [])
        returns = [(p, next(s.tracer.ids)) for p, _ in self.returns]
        s.invoke(InvokeProgram(self.pid, inputs, outputs + tuple(returns), feeds(self.feeds, flat, self.salt),
                               s.tracer.take_released()))
        for t, id in moved:
            t._handle = s.tracer.external(id)
        if settled is not None:
            self.settled = replace(settled, epoch=s.tracer.epoch)
        elif not moved and all(k.ref() is not None for k in self.outputs):
            held = tuple(pair for pair, i in zip(inputs, self.inputs, strict=True) if isinstance(i, FromState))
            self.settled = Settled(s.tracer.epoch, frozenset(b for _, b in held), held, outputs)
        outs = [MeshTensor(spec, s, s.tracer.external(id)) for (_, spec), (_, id) in zip(self.returns, returns,
                                                                                         strict=True)]
        return pytree.tree_unflatten(outs, self.spec)

    def _outputs(self, s: Session) -> tuple[tuple[tuple[int, int], ...], list[tuple[MeshTensor, int]]]:
        """Where each kept result goes: into the buffer its MeshTensor holds now, when nothing else
        holds that buffer (parameters and optimizer state are updated in place, no handle changes);
        else into a new buffer the MeshTensor is moved to."""
        outputs, moved = [], []
        for k in self.outputs:
            t = k.ref()
            if t is not None and s.tracer.live.get(t._handle.id) == 1:
                outputs.append((k.id, t._handle.id))
                continue
            new = next(s.tracer.ids)
            outputs.append((k.id, new))
            if t is None:
                s.tracer.released.append(new)  # nobody keeps it: freed with the next call
            else:
                moved.append((t, new))
        return tuple(outputs), moved


def feeds(slots: tuple[tuple[int, int], ...], flat: list[Any], salt: int | None) -> tuple[tuple[int, Any], ...]:
    """The plain tensor arguments' data under their feed ids (every rank gets all of it), as numpy
    arrays where numpy has the dtype: they pickle many times faster than tensors; and under `salt` a new
    draw of monarch.manual_seed's stream, so that the program's random ops draw new numbers each call."""
    data = tuple((fid, _portable(flat[slot].detach())) for fid, slot in slots)
    return data if salt is None else data + ((salt, _portable(torch.tensor(next_seed()))),)


def _portable(t: torch.Tensor) -> Any:
    try:
        return t.contiguous().numpy()
    except TypeError:  # bfloat16 and friends
        return t.contiguous()


class CompiledStep:
    """The callable `monarch.compile` returns; `traces` counts how often it recorded the step."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.cache: dict[Any, Program] = {}
        self.traces = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = list(args) if not kwargs and all(isinstance(a, _LEAVES) for a in args) else \
            pytree.tree_flatten((args, kwargs))[0]
        state = list(reachable(self.fn, flat))
        for obj in state:
            if isinstance(obj, torch.optim.Adam):
                make_capturable(obj)
        key = signature(flat, state)
        program = self.cache.get(key)
        why = "first call with this signature" if program is None else program.stale(flat)
        if isinstance(why, tuple):
            assert program is not None
            return program.run(flat, why)
        log.debug("monarch.compile: tracing %s (%s)", getattr(self.fn, "__qualname__", self.fn), why)
        program, result = self._trace(args, kwargs, flat, home(near(self.fn, flat), state))
        self.cache[key] = program
        return result

    def _trace(self, args: tuple, kwargs: dict, flat: list[Any], target: Session) -> tuple[Program, Any]:
        """Run the step while recording. Plain tensor arguments enter as replicated MeshTensors that
        each call fills (the step's own code then shards them, e.g. data_parallel's input hook)."""
        if target.tracer.n_ops:
            target.flush()
        sessions = list(all_sessions())
        fed = [target.tracer.feed(_replicated(t, target), i) if _plain(t) else t for i, t in enumerate(flat)]
        args, kwargs = pytree.tree_unflatten(fed, pytree.tree_flatten((args, kwargs))[1])
        captures = {s: Capture() for s in sessions}
        before = {s: s.tracer.epoch for s in sessions}
        for s in sessions:
            s.capturing, s.tracer.capture = True, captures[s]
        try:
            with capturable_on_cpu():
                result = self.fn(*args, **kwargs)
        finally:
            for s in sessions:
                s.capturing, s.tracer.capture = False, None
        used = [s for s in sessions if s.tracer.epoch != before[s]]
        if used != [target]:
            raise TraceError(f"a monarch.compile'd step must compute on one mesh, that of its arguments, "
                             f"parameters or optimizer; {getattr(self.fn, '__qualname__', self.fn)} used "
                             f"{[s.mesh for s in used]}")
        self.traces += 1
        return install(target, captures[target], result, flat)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not MeshTensor


def _replicated(t: torch.Tensor, s: Session) -> Spec:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return spec_of(meta, (Replicate(),) * len(s.abstract), s.abstract)


def home(near: list[Any], state: list[Any]) -> Session:
    """The session a step computes on: that of the MeshTensors or meshes it reaches (arguments first),
    else of its parameters (modules and optimizers it reaches), else the only mesh there is."""
    params = (p for obj in state for p in (obj.parameters() if isinstance(obj, torch.nn.Module) else
                                           (q for g in obj.param_groups for q in g["params"])))
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


def install(s: Session, cap: Capture, result: Any, flat: list[Any]) -> tuple[Program, Any]:
    """Close the recorded graph, install it as a program and run it for this call."""
    returned, spec = pytree.tree_flatten(result)
    if not all(isinstance(t, MeshTensor) for t in returned):
        raise TraceError("a monarch.compile'd step may return only MeshTensors (or nested lists, tuples and "
                         "dicts of them); return plain values from outside the step")
    traced = s.tracer.take()
    programs = partition(traced)
    if config.bucket_bytes() > 0:
        programs = overlap(programs, config.bucket_bytes())
    nodes = list(traced.graph.nodes)
    produced = {i for n in nodes if n.op != "placeholder" for i in n.meta["ids"]}
    slots = {t._handle.id: i for i, t in enumerate(flat) if isinstance(t, MeshTensor)}
    inputs = tuple(_input(i, slots, cap.sources[i], n.meta["specs"][0])
                   for n in nodes if n.op == "placeholder" for i in n.meta["ids"])
    mine = {id(t) for t in returned}
    outputs, seen = [], set()
    for ref in cap.touched:
        t = ref()
        if t is not None and id(t) not in mine and t._handle.id in produced and t._handle.id not in seen:
            seen.add(t._handle.id)
            outputs.append(Kept(t._handle.id, weakref.ref(t)))
    for t in returned:
        if t._handle.id not in produced:
            raise TraceError("a monarch.compile'd step returned one of its inputs unchanged; return only "
                             "tensors the step computes")
    fed = tuple((n.meta["ids"][0], n.meta["feed"]) for n in nodes if "feed" in n.meta)
    salt = cap.salt.meta["ids"][0] if cap.salt is not None else None
    program = Program(next(_pids), s, inputs, tuple(outputs), tuple((t._handle.id, t._spec) for t in returned),
                      fed, salt, spec)
    same = tuple((i.id, i.id) for i in inputs)
    kept = tuple((k.id, k.id) for k in outputs) + tuple((i, i) for i, _ in program.returns)
    s.invoke(InvokeProgram(program.pid, same, kept, feeds(fed, flat, salt)), programs)
    # buffers released while tracing live outside the program's own namespace: free them after it ran
    s.tracer.released.extend(i for i in traced.released if i not in produced)
    return program, result


def _input(id: int, slots: dict[int, int], source: weakref.ref[MeshTensor], spec: Spec) -> Input:
    """Placeholder `id`: filled by an argument when one holds it, else by the MeshTensor it was read
    from. Its spec is the object that MeshTensor holds now when equal (later checks are identity tests)."""
    t = source()
    if t is not None and t._spec == spec:
        spec = t._spec
    return FromArgument(id, slots[id], spec) if id in slots else FromState(id, source, spec)


def signature(flat: list[Any], state: list[Any]) -> tuple[Any, ...]:
    """What a cached program depends on besides the buffers it reads."""
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
    for obj in state:
        parts.append(_state_of(obj))
    return tuple(parts)


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.optim.Optimizer):
        groups = tuple(tuple((k, v) for k, v in g.items() if k != "params" and isinstance(v, (*CONSTANTS, tuple)))
                       for g in obj.param_groups)
        state = obj.state
        params = tuple((p.grad is None, len(state[p]) if p in state else 0)
                       for g in obj.param_groups for p in g["params"])
        return ("optimizer", id(obj), groups, params)
    return ("module", id(obj), obj.training)  # its parameters' gradients count with their optimizer


def near(fn: Callable[..., Any], flat: list[Any]) -> list[Any]:
    """What the step can reach: its arguments, closure cells and the globals it names."""
    candidates = list(flat)
    candidates += [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        candidates += [env[n] for n in code.co_names if n in env]
    if hasattr(fn, "__self__"):
        candidates.append(fn.__self__)
    return candidates


def reachable(fn: Callable[..., Any], flat: list[Any]) -> Iterator[Any]:
    """The optimizers and modules the step can reach."""
    seen: set[int] = set()
    for obj in near(fn, flat):
        if isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)) and id(obj) not in seen:
            seen.add(id(obj))
            yield obj


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def make_capturable(opt: torch.optim.Adam) -> None:
    """Adam keeps its step count on the controller unless capturable; a compiled step needs it as a
    replicated MeshTensor, so that bias corrections are computed by the program, not baked into it."""
    from monarch.runtime.session.api import distribute_tensor
    if getattr(opt, "_monarch_steps", -1) == len(opt.state):
        return  # every state present was converted already
    for group in opt.param_groups:
        params = [p for p in group["params"] if isinstance(p, MeshTensor)]
        if not params:
            continue
        group["capturable"] = True
        for p in params:
            st = opt.state.get(p)
            if st and "step" in st and not isinstance(st["step"], MeshTensor):
                st["step"] = distribute_tensor(st["step"].to(torch.float32), p.mesh)
    opt._monarch_steps = len(opt.state)  # type: ignore[attr-defined]
    _step_eagerly_too(opt)


def _step_eagerly_too(opt: torch.optim.Optimizer) -> None:
    """A capturable optimizer must also step outside a compiled step (eagerly, after a resume): this one
    optimizer's `step` runs under capturable_on_cpu(), other optimizers keep torch's check."""
    if "step" in vars(opt):
        return
    own = opt.step

    @functools.wraps(own)
    def step(*args: Any, **kwargs: Any) -> Any:
        with capturable_on_cpu():
            return own(*args, **kwargs)
    opt.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """The hook under which a step is recorded: capturable Adam (and AdamW) checks that parameters and
    step counts are on a device `torch.optim.adam._get_capturable_supported_devices()` names, and
    MeshTensors report cpu (their step counts are MeshTensors that make_capturable made). While the
    step runs, that function also names cpu; torch's own is put back after, also when the step raises."""
    own = torch_adam._get_capturable_supported_devices

    def supported(*a: Any, **kw: Any) -> list[str]:
        return [*own(*a, **kw), "cpu"]
    torch_adam._get_capturable_supported_devices = supported  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_adam._get_capturable_supported_devices = own


def compile(fn: Callable[..., Any]) -> CompiledStep:  # noqa: A001 - the public name is monarch.compile
    """Trace `fn` once per signature into one program per rank; later calls replay it."""
    return CompiledStep(fn)
