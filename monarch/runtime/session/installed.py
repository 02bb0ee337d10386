"""An installed compiled step (`InstalledStep`): the program on the workers and how each call binds to it.

A call's inputs are the MeshTensor arguments, the state the step reads (parameters, optimizer state,
`.grad`s: held weakly) and the plain tensors fed each call; its kept results move into the MeshTensors
the step updated. `fit` says whether the program still fits a call, `run` sends the call.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from monarch.graph.trace import Tracer
from monarch.runtime.control.commands import InvokeProgram
from monarch.runtime.session.crossmesh import Side, drop_stages
from monarch.runtime.session.guards import Guards
from monarch.runtime.session.session import Session
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.random import next_seed
from monarch.tensor.spec import Spec


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


class FromGrad(NamedTuple):
    """A program input read from a parameter's `.grad` (backward accumulates into it), found through the
    parameter at each call: gradients come and go (zero_grad), parameters stay. Held weakly."""
    id: int  # placeholder id
    param: weakref.ref[MeshTensor]
    spec: Spec

    def tensor(self, flat: list[Any]) -> MeshTensor | None:
        p = self.param()
        return None if p is None else p.grad


Input = FromArgument | FromState | FromGrad


class Kept(NamedTuple):
    """A result the step leaves in a MeshTensor it does not return (updated parameters, optimizer state)."""
    id: int  # produced id
    ref: weakref.ref[MeshTensor]

    def current(self) -> MeshTensor | None:
        return self.ref()

    def holder(self) -> Any:
        return self.ref()

    def bind(self, s: Session, buffer: int) -> None:
        self.ref()._handle = s.tracer.external(buffer)


class KeptGrad(NamedTuple):
    """A gradient the step leaves in a parameter's `.grad`: in the MeshTensor there, or (after zero_grad set
    it to None) in a new one, as torch's backward does."""
    id: int  # produced id
    param: weakref.ref[MeshTensor]
    spec: Spec

    def current(self) -> MeshTensor | None:
        p = self.param()
        return None if p is None else p.grad

    def holder(self) -> Any:
        return self.param()

    def bind(self, s: Session, buffer: int) -> None:
        p = self.param()
        if p.grad is None:
            p.grad = MeshTensor(self.spec, s, s.tracer.external(buffer))
        else:
            p.grad._handle = s.tracer.external(buffer)


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


@dataclass(frozen=True)
class Fit:
    """Whether an installed step fits a call: why not, or (when `why` is None) the (placeholder id, buffer
    id) pairs of the buffers the call reads; for a Joint, each program's fit."""
    reads: tuple[tuple[int, int], ...] = ()
    why: str | None = None
    parts: tuple[Fit, ...] = ()


@dataclass
class InstalledStep:
    """One program installed on the workers for a compiled step, and how a call binds to it."""
    pid: int
    session: Session
    inputs: tuple[Input, ...]
    outputs: tuple[Kept | KeptGrad, ...]
    returns: tuple[tuple[int, Spec], ...]              # produced ids of the returned tensors, their specs
    feeds: tuple[tuple[int, Any], ...]                 # feed id, argument slot or getter (replicated)
    salt: int | None                                   # feed id of the random ops' per-call salt
    spec: pytree.TreeSpec                              # structure of the return value
    guards: Guards                                     # the Python state it was recorded with
    settles: bool = True                               # whether calls may bind as the previous (no gradients)
    settled: Settled | None = None

    def fit(self, flat: list[Any]) -> Fit:
        """Whether the program still fits its inputs: the buffers this call reads, or why not."""
        settled = self.settled
        if settled is not None and settled.valid(self.session.tracer):
            fit = self._check(flat, [i for i in self.inputs if isinstance(i, FromArgument)])
            return fit if fit.why else Fit(settled.held + fit.reads)
        self.settled = None
        return self._check(flat, self.inputs)

    def _check(self, flat: list[Any], which: Iterable[Input]) -> Fit:
        inputs = []
        for i in which:
            t = i.tensor(flat)
            if t is None:
                return Fit(why=f"input buffer %{i.id} is gone")
            if t._spec is not i.spec and t._spec != i.spec:
                return Fit(why=f"input {i.spec} is now {t._spec}")
            inputs.append((i.id, t._handle.id))
        return Fit(tuple(inputs))

    def forget(self) -> None:
        """It will not run again: the workers drop it with the next call."""
        self.session.forget(self.pid)

    def run(self, flat: list[Any], fit: Fit) -> Any:
        inputs = fit.reads
        s = self.session
        if s.tracer.n_ops:
            s.flush()  # work recorded between calls runs first
        settled = self.settled
        outputs, moved = self._outputs(s) if settled is None else (settled.outputs, [])
        returns = [(p, next(s.tracer.ids)) for p, _ in self.returns]
        s.invoke(InvokeProgram(self.pid, inputs, outputs + tuple(returns), feeds(self.feeds, flat, self.salt),
                               s.tracer.take_released()))
        for k, id in moved:
            k.bind(s, id)
        if settled is not None:
            self.settled = replace(settled, epoch=s.tracer.epoch)
        elif not moved and self.settles and all(k.current() is not None for k in self.outputs):
            held = tuple(pair for pair, i in zip(inputs, self.inputs, strict=True) if isinstance(i, FromState))
            self.settled = Settled(s.tracer.epoch, frozenset(b for _, b in held), held, outputs)
        outs = [MeshTensor(spec, s, s.tracer.external(id)) for (_, spec), (_, id) in zip(self.returns, returns,
                                                                                         strict=True)]
        return pytree.tree_unflatten(outs, self.spec)

    def _outputs(self, s: Session) -> tuple[tuple[tuple[int, int], ...], list[tuple[Kept | KeptGrad, int]]]:
        """Where each kept result goes: into the buffer its MeshTensor holds now, when nothing else
        holds that buffer (parameters and optimizer state are updated in place, no handle changes);
        else into a new buffer the MeshTensor is moved to (or, for a `.grad` that is None, made for)."""
        outputs, moved = [], []
        for k in self.outputs:
            t = k.current()
            if t is not None and s.tracer.live.get(t._handle.id) == 1:
                outputs.append((k.id, t._handle.id))
                continue
            new = next(s.tracer.ids)
            outputs.append((k.id, new))
            if k.holder() is None:
                s.tracer.released.append(new)  # nobody keeps it: freed with the next call
            else:
                moved.append((k, new))
        return tuple(outputs), moved


@dataclass
class Joint:
    """A compiled step that moves tensors between meshes (to_mesh): one installed program per mesh, sent
    together each call (each waits on its workers for the other's pieces). `places`: for each returned tensor,
    the program returning it and its position among that program's results."""
    parts: tuple[InstalledStep, ...]
    places: tuple[tuple[int, int], ...]
    spec: pytree.TreeSpec
    stages: tuple[tuple[Side, int], ...] = ()  # the workers' stages of its crossings: (source session, site)

    @property
    def guards(self) -> Guards:
        return self.parts[0].guards  # one recording: the same Python state for every program

    def fit(self, flat: list[Any]) -> Fit:
        fits = tuple(p.fit(flat) for p in self.parts)
        why = next((f.why for f in fits if f.why is not None), None)
        return Fit(why=why, parts=fits)

    def run(self, flat: list[Any], fit: Fit) -> Any:
        results = [part.run(flat, f) for part, f in zip(self.parts, fit.parts, strict=True)]
        return pytree.tree_unflatten([results[p][k] for p, k in self.places], self.spec)

    def forget(self) -> None:
        for part in self.parts:
            part.forget()
        drop_stages(self.stages)


def feeds(slots: tuple[tuple[int, Any], ...], flat: list[Any], salt: int | None) -> tuple[tuple[int, Any], ...]:
    """The plain tensor arguments' data under their feed ids (every rank gets all of it), as numpy
    arrays where numpy has the dtype: they pickle many times faster than tensors; and under `salt` a new
    draw of monarch.manual_seed's stream, so that the program's random ops draw new numbers each call."""
    data = tuple((fid, _portable(flat[slot].detach() if isinstance(slot, int) else slot())) for fid, slot in slots)
    return data if salt is None else data + ((salt, _portable(torch.tensor(next_seed(), device="cpu"))),)


def _portable(t: torch.Tensor) -> Any:
    try:
        return t.contiguous().numpy()
    except TypeError:  # bfloat16 and friends
        return t.contiguous()
