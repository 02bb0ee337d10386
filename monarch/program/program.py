"""Per-rank programs and their encoding: `RankProgram`, and `share`/`assemble`, which are inverses.

The controller encodes the programs of one flush with `share` (instructions every rank holds as the
same object are pickled once into a blob all messages carry; the rest become each rank's patches), and a
worker decodes its own with `assemble`. The encoding is plain pickle: instructions are monarch's own
data, never code, so nothing needs cloudpickle.
"""
from __future__ import annotations

import operator
import pickle
from dataclasses import dataclass

from monarch.program.instr import Instr

Patches = tuple[tuple[int, Instr], ...]  # (position, instruction) pairs a rank puts over the shared ones


@dataclass(frozen=True)
class RankProgram:
    """What one mesh point runs for one flushed graph; it knows the abstract mesh only (coordinates, mesh
    dims by index), and lowering binds it to the processes of a concrete mesh view."""
    coords: tuple[int, ...]
    instrs: tuple[Instr, ...]

    def __str__(self) -> str:
        return "\n".join([f"rank {self.coords}:"] + [f"  {ins!r}" for ins in self.instrs])


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
    blob = pickle.dumps(tuple(shared), protocol=5)
    return blob, [tuple((i, p.instrs[i]) for i in varying) for p in programs]


def assemble(shared: bytes, patches: Patches) -> tuple[Instr, ...]:
    """A rank's program: the instructions all ranks share with this rank's own ones patched in."""
    instrs = list(pickle.loads(shared))
    for i, ins in patches:
        instrs[i] = ins
    return tuple(instrs)
