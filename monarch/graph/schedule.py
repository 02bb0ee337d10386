"""Scheduling of compiled programs: all_reduces start early, in buckets, and are waited for late.

A compiled step's gradient all_reduces are recorded where the optimizer first needs a reduced
gradient, after the whole backward. This pass moves each one up to just after the last instruction
that writes its input, as a non-blocking Start, and leaves a Wait where the result is first needed,
so the reduction overlaps the rest of the backward. Neighbouring Starts on the same mesh dim, op and
dtype share one bucket (one collective) up to `bucket_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from monarch.program.instr import Buf, Comm, Instr, Local, Start, Wait
from monarch.program.program import RankProgram


@dataclass
class _Bucket:
    start_at: int           # the Start goes after this instruction (-1: first)
    wait_at: int            # the Wait goes before this instruction
    members: list[int]      # indices of the all_reduce Comms
    nbytes: int


def overlap(programs: tuple[RankProgram, ...], bucket_bytes: int) -> tuple[RankProgram, ...]:
    """The same programs with their all_reduces split into bucketed Starts and Waits."""
    first = programs[0].instrs
    buckets = _buckets(first, bucket_bytes)
    if not buckets:
        return programs
    return tuple(RankProgram(p.coords, _rewrite(p.instrs, buckets)) for p in programs)


def _buckets(instrs: tuple[Instr, ...], limit: int) -> list[_Bucket]:
    reduces = [i for i, ins in enumerate(instrs) if isinstance(ins, Comm) and ins.kind == "all_reduce"]
    found: list[_Bucket] = []
    for i in sorted(reduces, key=lambda i: (_last_writer(instrs, i), i)):
        c = instrs[i]
        assert isinstance(c, Comm)
        at, size = _last_writer(instrs, i), prod(c.shapes[0]) * c.dtype.itemsize
        b = found[-1] if found else None
        if b is not None and _fits(instrs[b.members[0]], c) and b.nbytes + size <= limit and \
                max(b.start_at, at) < min(b.wait_at, i):
            b.members.append(i)
            b.start_at, b.wait_at, b.nbytes = max(b.start_at, at), min(b.wait_at, i), b.nbytes + size
        else:
            found.append(_Bucket(at, i, [i], size))
    return found


def _fits(a: Instr, b: Comm) -> bool:
    return isinstance(a, Comm) and (a.mdim, a.op, a.dtype) == (b.mdim, b.op, b.dtype)


def _last_writer(instrs: tuple[Instr, ...], i: int) -> int:
    """Index of the last instruction before i that writes the storage Comm i reads (-1: none)."""
    c = instrs[i]
    assert isinstance(c, Comm)
    for j in range(i - 1, -1, -1):
        ins = instrs[j]
        if c.src in _writes(ins):
            return j
    return -1


def _writes(ins: Instr) -> tuple[int, ...]:
    if isinstance(ins, Local):
        mutated = ins.args[0].id if ins.op.split(".")[0].endswith("_") and ins.args and \
            isinstance(ins.args[0], Buf) else None
        return ins.outs + ((mutated,) if mutated is not None else ())
    if isinstance(ins, (Comm,)):
        return (ins.out,)
    if isinstance(ins, Wait):
        return ins.outs
    return ()


def _rewrite(instrs: tuple[Instr, ...], buckets: list[_Bucket]) -> tuple[Instr, ...]:
    starts: dict[int, list[Instr]] = {}
    waits: dict[int, list[Instr]] = {}
    moved = set()
    for b in buckets:
        comms = [instrs[m] for m in b.members]
        assert all(isinstance(c, Comm) for c in comms)
        srcs = tuple(c.src for c in comms)  # type: ignore[union-attr]
        outs = tuple(c.out for c in comms)  # type: ignore[union-attr]
        c0 = comms[0]
        assert isinstance(c0, Comm)
        shapes = tuple(c.shapes[0] for c in comms)  # type: ignore[union-attr]
        starts.setdefault(b.start_at, []).append(Start(srcs, outs, c0.mdim, c0.op, c0.dtype, shapes))
        waits.setdefault(b.wait_at, []).append(Wait(outs))
        moved.update(b.members)
    out: list[Instr] = list(starts.get(-1, []))
    for i, ins in enumerate(instrs):
        out.extend(waits.get(i, []))
        if i not in moved:
            out.append(ins)
        out.extend(starts.get(i, []))
    return tuple(out)
