"""RankProgram: what one mesh point runs for one flushed graph, the output of partitioning.

A RankProgram knows the abstract mesh only (coordinates, mesh dims by index); lowering binds it to the
processes of a concrete mesh view.
"""
from __future__ import annotations

from dataclasses import dataclass

from monarch.tensor.instr import Instr


@dataclass(frozen=True)
class RankProgram:
    """The instructions one mesh point runs for one flushed graph, and the buffers it frees after."""
    coords: tuple[int, ...]
    instrs: tuple[Instr, ...]

    def __str__(self) -> str:
        return "\n".join([f"rank {self.coords}:"] + [f"  {ins!r}" for ins in self.instrs])
