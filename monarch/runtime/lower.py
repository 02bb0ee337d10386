"""Lowering: RankPrograms of the abstract mesh become RunProgram messages for a concrete mesh view.

Programs come in row-major coordinate order, which is the order of the view's ranks; each rank gets
one message per flush. Instructions every rank shares are pickled once into a blob that all messages
carry; each message adds its rank's own instructions as patches. A synchronising flush asks every
rank to reply, and only the first rank to send the fetched value (every rank reports its errors).
"""
from __future__ import annotations

from monarch.graph.program import RankProgram
from monarch.runtime import codec
from monarch.runtime.commands import RunProgram
from monarch.runtime.shape import Shape


def lower(programs: tuple[RankProgram, ...], view: Shape, call_id: int = 0,
          fetch: int = 0) -> dict[int, RunProgram]:
    """Messages by world rank."""
    ranks = view.ranks()
    assert len(ranks) == len(programs), f"{len(programs)} programs for a view of {len(ranks)} ranks"
    first = programs[0].instrs
    assert all(len(p.instrs) == len(first) for p in programs), "rank programs differ in length"
    varying = [i for i, ins in enumerate(first) if any(p.instrs[i] is not ins for p in programs[1:])]
    shared = list(first)
    for i in varying:
        shared[i] = None
    blob = codec.dumps(tuple(shared))
    return {r: RunProgram(view, blob, tuple((i, p.instrs[i]) for i in varying), call_id, fetch if n == 0 else 0)
            for n, (r, p) in enumerate(zip(ranks, programs, strict=True))}
