"""Lowering: RankPrograms of the abstract mesh become messages for the processes of a concrete mesh view.

Programs come in row-major coordinate order, which is the order of the view's ranks; each rank gets
one message per flush. Instructions every rank shares are pickled once into a blob that all messages
carry; each message adds its rank's own instructions as patches. A synchronising flush asks every
rank to reply: `fetch` maps the index of each rank that sends a buffer to that buffer's id (every rank
reports its errors). A compiled program is installed the same way, once, under a program id.
"""
from __future__ import annotations

import operator

from monarch.graph.partition import RankProgram
from monarch.runtime.control import codec
from monarch.runtime.control.commands import InstallProgram, RunProgram
from monarch.shape import Shape
from monarch.program.instr import Instr

Patches = tuple[tuple[int, Instr], ...]


def share(programs: tuple[RankProgram, ...]) -> tuple[bytes, list[Patches]]:
    """The pickled instructions every rank has in common, and each rank's own ones."""
    first = programs[0].instrs
    assert all(len(p.instrs) == len(first) for p in programs), "rank programs differ in length"
    differs = [False] * len(first)
    for p in programs[1:]:
        differs = list(map(operator.or_, differs, map(operator.is_not, first, p.instrs)))
    varying = [i for i, d in enumerate(differs) if d]
    shared: list[Instr | None] = list(first)
    for i in varying:
        shared[i] = None
    return codec.dumps_data(tuple(shared)), [tuple((i, p.instrs[i]) for i in varying) for p in programs]


def _ranks(programs: tuple[RankProgram, ...], view: Shape) -> list[int]:
    ranks = view.ranks()
    assert len(ranks) == len(programs), f"{len(programs)} programs for a view of {len(ranks)} ranks"
    return ranks


def lower(programs: tuple[RankProgram, ...], view: Shape, call_id: int = 0,
          fetch: dict[int, int] | None = None) -> dict[int, RunProgram]:
    """Messages by world rank."""
    ranks = _ranks(programs, view)
    blob, patches = share(programs)
    fetch = fetch or {}
    return {r: RunProgram(view, blob, patches[n], call_id, fetch.get(n, 0)) for n, r in enumerate(ranks)}


def lower_install(pid: int, programs: tuple[RankProgram, ...], view: Shape) -> dict[int, InstallProgram]:
    ranks = _ranks(programs, view)
    blob, patches = share(programs)
    return {r: InstallProgram(pid, view, blob, patches[n]) for n, r in enumerate(ranks)}
