"""The single-process reference: a mesh simulated in this process, a test oracle for the real one.

`LocalMesh({"dp": 2, "tp": 2})` can be passed wherever a ProcMesh is (`mesh=`, `distribute_tensor`).
Its session partitions exactly like the real one; its runner then steps every rank's program in
lockstep with one Engine per rank and the collectives of `collectives.py`. It never replaces the
multi-process path; tests compare the two, and both against plain torch.
"""
from __future__ import annotations

from typing import cast

import torch

from monarch.errors import MeshError
from monarch.program.collectives import RUN
from monarch.program.instr import Comm, Free, Start
from monarch.program.program import RankProgram
from monarch.runtime.control import codec
from monarch.runtime.control.commands import InvokeProgram
from monarch.runtime.control.futures import CallState
from monarch.runtime.engine import buckets
from monarch.runtime.engine.engine import Engine
from monarch.runtime.session.session import Fetch, Session
from monarch.shape import DeviceMeshNames, MeshView, Shape, group_coords


def _bucket(engines: list[Engine], programs: tuple[RankProgram, ...], i: int, sizes: tuple[int, ...],
            index: dict[tuple[int, ...], int]) -> None:
    """A bucketed Start, finished at once for every group (its Wait then has nothing left to do)."""
    done: set[tuple[int, ...]] = set()
    for p in programs:
        if p.coords in done:
            continue
        d = cast(Start, p.instrs[i]).mdim
        members = group_coords(p.coords, d, sizes)
        done.update(members)
        starts = [cast(Start, programs[index[c]].instrs[i]) for c in members]
        parts = [engines[index[c]].bucket_input(s) for c, s in zip(members, starts, strict=True)]
        for c, s, out in zip(members, starts, RUN[starts[0].kind](parts, buckets.comm(starts[0])), strict=True):
            engines[index[c]].bucket_output(s, out)


class LocalMesh(DeviceMeshNames, MeshView):
    """Named mesh dims simulated in this process; `with LocalMesh(...):` makes it monarch.dtensor's default mesh."""
    device = "cpu"

    def __init__(self, dims: dict[str, int]) -> None:
        self._shape = Shape.row_major(tuple(dims), tuple(int(n) for n in dims.values()))
        self.session = Session(self, LockstepRunner(self._shape))  # of its one view

    def _with_shape(self, shape: Shape) -> LocalMesh:
        raise MeshError("a LocalMesh cannot be sliced; build a LocalMesh with the dims you need")

    def __repr__(self) -> str:
        return f"<LocalMesh {self.extent}>"


class LockstepRunner:
    """Runs a session's programs here, on one Engine per mesh point, every rank's instruction i before
    any rank's instruction i+1. Its calls are answered before `run` returns: it is its own waiter."""
    live = True
    threaded = False

    def __init__(self, view: Shape) -> None:
        self.view = view
        self.sizes = view.sizes
        self.labels = [view.point(i).label() for i in range(len(view))]
        self.engines = [Engine(r) for r in range(len(view))]
        self._installed: dict[int, tuple[RankProgram, ...]] = {}

    @property
    def waiter(self) -> LockstepRunner:
        return self

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        assert state.done, f"{state.what}: {arrived} of {len(state.raw)} ranks answered"

    def run(self, programs: tuple[RankProgram, ...], fetch: Fetch | None, sync: bool) -> CallState | None:
        with _as_a_worker():
            run_lockstep(self.engines, programs, self.sizes, self.labels)
            if not sync:
                return None
            state = CallState(self.view, "reference program")
            sources = fetch.sources() if fetch else {}
            for r, eng in enumerate(self.engines):
                try:
                    state.deliver(r, True, codec.dumps_data(eng.fetch(sources.get(r, 0))))
                except Exception as e:  # noqa: BLE001
                    state.deliver(r, False, e)
            return state

    def invoke(self, call: InvokeProgram, install: tuple[RankProgram, ...] | None) -> None:
        if install is not None:
            self._installed[call.pid] = install
        for pid in call.forget:
            self._installed.pop(pid, None)
        outers = []
        for eng in self.engines:
            eng.free(Free(call.frees))
            outers.append(eng.bind(call.inputs, call.feeds))
        try:
            with _as_a_worker():
                run_lockstep(self.engines, self._installed[call.pid], self.sizes, self.labels)
        finally:
            for eng, outer in zip(self.engines, outers, strict=True):
                eng.unbind(call.outputs, outer)


def _as_a_worker() -> torch._C.DisableTorchFunction:
    """The engines run plain torch, as in a worker process: the controller's torch-function modes (the
    factories of `activate()`, which would make their `torch.rand` a MeshTensor) do not apply to them."""
    return torch._C.DisableTorchFunction()


def run_lockstep(engines: list[Engine], programs: tuple[RankProgram, ...], sizes: tuple[int, ...],
                 labels: list[str]) -> None:
    """Run instruction i on every rank before instruction i+1; a Comm runs once per group."""
    lengths = {len(p.instrs) for p in programs}
    assert len(lengths) == 1, f"rank programs differ in length: {sorted(lengths)}"
    for eng, p, label in zip(engines, programs, labels, strict=True):
        eng.coords, eng.label = p.coords, label
    index = {p.coords: i for i, p in enumerate(programs)}
    for i in range(lengths.pop()):
        first = programs[0].instrs[i]
        if isinstance(first, Start):
            _bucket(engines, programs, i, sizes, index)
            continue
        if not isinstance(first, Comm):
            for eng, p in zip(engines, programs, strict=True):
                eng.run((p.instrs[i],), p.coords, eng.label)
            continue
        done: set[tuple[int, ...]] = set()
        for p in programs:
            if p.coords in done:
                continue
            d = first.mdim
            members = group_coords(p.coords, d, sizes)
            done.update(members)
            comms = [cast(Comm, programs[index[c]].instrs[i]) for c in members]
            assert all(isinstance(c, Comm) for c in comms), f"instruction {i}: ranks disagree on a collective"
            parts = [engines[index[c]].comm_input(ins) for c, ins in zip(members, comms, strict=True)]
            outs = RUN[first.kind](parts, first)
            for c, ins, out in zip(members, comms, outs, strict=True):
                engines[index[c]].comm_output(ins, out)
