"""Lowering: RankPrograms of the abstract mesh become RunProgram messages for a concrete mesh view.

Programs come in row-major coordinate order, which is the order of the view's ranks; each rank gets
one message per flush. Instructions every rank shares are pickled once into a blob that all messages
carry; each message adds its rank's own instructions as patches. A synchronising flush asks every
rank to reply: `fetch` maps the index of each rank that sends a buffer to that buffer's id (every rank
reports its errors).
"""
from __future__ import annotations

import operator

from monarch.graph.partition import RankProgram
from monarch.tensor.instr import Instr
from monarch.runtime import codec
from monarch.runtime.commands import RunProgram
from monarch.runtime.shape import Shape


def lower(programs: tuple[RankProgram, ...], view: Shape, call_id: int = 0,
          fetch: dict[int, int] | None = None) -> dict[int, RunProgram]:
    """Messages by world rank."""
    ranks = view.ranks()
    assert len(ranks) == len(programs), f"{len(programs)} programs for a view of {len(ranks)} ranks"
    first = programs[0].instrs
    assert all(len(p.instrs) == len(first) for p in programs), "rank programs differ in length"
    differs = [False] * len(first)
    for p in programs[1:]:
        differs = list(map(operator.or_, differs, map(operator.is_not, first, p.instrs)))
    varying = [i for i, d in enumerate(differs) if d]
    shared: list[Instr | None] = list(first)
    for i in varying:
        shared[i] = None
    blob = codec.dumps_data(tuple(shared))
    fetch = fetch or {}
    return {r: RunProgram(view, blob, tuple((i, p.instrs[i]) for i in varying), call_id, fetch.get(n, 0))
            for n, (r, p) in enumerate(zip(ranks, programs, strict=True))}
