"""Lowering: RankPrograms of the abstract mesh become RunProgram messages for a concrete mesh view.

Programs come in row-major coordinate order, which is the order of the view's ranks; each rank gets
its own message (one frame per worker per flush). A synchronising flush asks every rank to reply,
and only the first rank to send the fetched value (every rank reports its errors).
"""
from __future__ import annotations

from monarch.graph.program import RankProgram
from monarch.runtime.commands import RunProgram
from monarch.runtime.shape import Shape


def lower(programs: tuple[RankProgram, ...], view: Shape, call_id: int = 0,
          fetch: int = 0) -> dict[int, RunProgram]:
    """Messages by world rank."""
    ranks = view.ranks()
    assert len(ranks) == len(programs), f"{len(programs)} programs for a view of {len(ranks)} ranks"
    return {r: RunProgram(view, p.instrs, call_id, fetch if i == 0 else 0)
            for i, (r, p) in enumerate(zip(ranks, programs, strict=True))}
