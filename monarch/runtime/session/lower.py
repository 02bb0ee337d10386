"""Lowering: RankPrograms of the abstract mesh become messages for the processes of a concrete mesh view.

Programs come in row-major coordinate order, which is the order of the view's ranks; each rank gets
one message per flush, encoded by `monarch.program.program.share`: instructions every rank shares are
pickled once into a blob that all messages carry, and each message adds its rank's own instructions as
patches. A synchronising flush asks every rank to reply: `fetch` maps the index of each rank that
sends a buffer to that buffer's id (every rank reports its errors). A compiled program is installed
the same way, once, under a program id.
"""
from __future__ import annotations

from monarch.program.program import RankProgram, share
from monarch.runtime.control.commands import InstallProgram, RunProgram
from monarch.shape import Shape


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
