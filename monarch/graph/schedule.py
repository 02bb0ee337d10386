"""Scheduling of compiled programs: collectives start early, in DDP-like buckets, and are waited for late.

A compiled step's gradient all_reduces (or, with weight-update sharding, reduce_scatters) are recorded where
the optimizer step begins, after the whole backward, and the all_gathers of updated slices after it. This pass
moves each one up to just after the last instruction that writes its input (or any tensor sharing its memory),
as a Start, and leaves a Wait where its result is first read, so an all_reduce overlaps the rest of the
backward. As in DDP, collectives of the same kind, mesh dim, op and dtype share buckets in the order their
inputs become ready, up to `bucket_bytes`; a bucket closes once it reaches its size. The first all_reduce
bucket holds about 1 MiB, so that communication starts early (the engine runs an all_reduce bucket in the
background; the other kinds where they start). A bucket is one collective over one flat buffer.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod
from typing import Any, cast

import torch

from monarch.program.instr import Buf, Comm, Free, Instr, Local, Start, Wait
from monarch.program.program import RankProgram
from monarch.tensor.placement import chunk

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
BUCKETED = frozenset({"all_reduce", "reduce_scatter", "all_gather"})


def overlap(programs: tuple[RankProgram, ...], bucket_bytes: int) -> tuple[RankProgram, ...]:
    """The same programs with their all_reduces, reduce_scatters and all_gathers in bucketed Starts and Waits."""
    first = programs[0].instrs
    # a reduce_scatter or all_gather alone stays a plain collective: packing it would only add copies
    buckets = [b for b in _buckets(first, bucket_bytes)
               if len(b.members) > 1 or cast(Comm, first[b.members[0]]).kind == "all_reduce"]
    if not buckets:
        return programs
    return tuple(RankProgram(p.coords, _rewrite(p.instrs, buckets, p.coords)) for p in programs)


@dataclass
class _Bucket:
    start_at: int           # the Start goes after this instruction (-1: first): its inputs' last writer
    before: int             # ... and not after this one, the earliest of its all_reduces (inputs still alive)
    wait_at: int            # the Wait goes before this instruction: the first that reads a result
    limit: int              # bytes at which the bucket is full
    members: list[int] = field(default_factory=list)  # indices of the Comms
    nbytes: int = 0

    def takes(self, ready: int, i: int) -> bool:
        return self.nbytes < self.limit and max(self.start_at, ready) <= min(self.before, i)

    def add(self, i: int, ready: int, need: int, nbytes: int) -> None:
        self.members.append(i)
        self.start_at, self.before = max(self.start_at, ready), min(self.before, i)
        self.wait_at, self.nbytes = min(self.wait_at, need), self.nbytes + nbytes


def _buckets(instrs: tuple[Instr, ...], limit: int) -> list[_Bucket]:
    flow = _Flow(instrs)
    reduces = sorted((*flow.ready(i), i) for i, ins in enumerate(instrs)
                     if isinstance(ins, Comm) and ins.kind in BUCKETED)
    found: list[_Bucket] = []
    open_: dict[tuple[str, int, str, torch.dtype], _Bucket] = {}
    bucket_of: dict[int, _Bucket] = {}
    for ready, producer, i in reduces:
        if producer >= 0:  # its input is another collective's result: ready where that one's bucket is waited for
            ready = bucket_of[producer].wait_at
        c = instrs[i]
        assert isinstance(c, Comm)
        key = (c.kind, c.mdim, c.op, c.dtype)
        b = open_.get(key)
        if b is None or not b.takes(ready, i):
            first = key not in open_ and c.kind == "all_reduce"  # (the others run where they start: no overlap)
            b = _Bucket(ready, i, len(instrs), min(FIRST_BUCKET_BYTES, limit) if first else limit)
            found.append(b)
            open_[key] = b
        moved = sum(prod(s) for s in c.shapes) if c.kind == "all_gather" else prod(c.shapes[0])
        b.add(i, ready, flow.need(i), moved * c.dtype.itemsize)
        bucket_of[i] = b
    return found


class _Flow:
    """Where each bucketed collective's input is last written and its result first read. A write to a tensor that
    may share memory with the input (a view, as the aten schemas say, or any output of a kernel without
    one) counts as a write to the input."""

    def __init__(self, instrs: tuple[Instr, ...]) -> None:
        self.instrs = instrs
        self.parent: dict[int, int] = {}
        self.mutated: list[frozenset[int]] = []
        for ins in instrs:
            mutated, aliased = _effects(ins) if isinstance(ins, Local) else ((), ())
            for o in ins.outs if isinstance(ins, Local) else ():
                for a in aliased:
                    self.parent[self.root(o)] = self.root(a)
            self.mutated.append(frozenset(mutated))
        self.mutated = [frozenset(self.root(m) for m in ms) for ms in self.mutated]

    def root(self, i: int) -> int:
        while (p := self.parent.get(i, i)) != i:
            i = p
        return i

    def ready(self, i: int) -> tuple[int, int]:
        """Index of the last instruction before collective i that writes its input (-1: none), and -1; for an
        input that another bucketed collective j wrote, the first reader of j's result (where j's Wait goes at
        the latest), and j."""
        c = self.instrs[i]
        assert isinstance(c, Comm)
        group = self.root(c.src)
        for j in range(i - 1, -1, -1):
            w = self.instrs[j]
            if group in self.mutated[j] or c.src in _defines(w):
                return (self.need(j), j) if isinstance(w, Comm) and w.kind in BUCKETED else (j, -1)
        return -1, -1

    def need(self, i: int) -> int:
        """Index of the first instruction after collective i that reads its result (the end: none)."""
        out = self.instrs[i]
        assert isinstance(out, Comm)
        return next((k for k in range(i + 1, len(self.instrs)) if out.out in _reads(self.instrs[k])),
                    len(self.instrs))


def _defines(ins: Instr) -> tuple[int, ...]:
    if isinstance(ins, Local):
        return ins.outs
    if isinstance(ins, Comm):
        return (ins.out,)
    return ins.outs if isinstance(ins, Wait) else ()


def _reads(ins: Instr) -> set[int]:
    if isinstance(ins, Local):
        return set(_bufs((ins.args, ins.kwargs)))
    if isinstance(ins, Comm):
        return {ins.src}
    if isinstance(ins, Start):
        return set(ins.srcs)
    return set(ins.ids) if isinstance(ins, Free) else set()


def _bufs(obj: Any) -> Iterator[int]:
    if type(obj) is Buf:
        yield obj.id
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _bufs(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _bufs(o)


def _effects(ins: Local) -> tuple[list[int], list[int]]:
    """The buffers kernel `ins` mutates, and those its outputs may be views of."""
    schema = _schema(ins.op)
    if schema is None:  # a monarch:: kernel: in place when named so, and its outputs may alias any input
        inputs = list(_bufs((ins.args, ins.kwargs)))
        return (inputs[:1] if ins.op.split(".")[0].endswith("_") else []), inputs
    names = [a.name for a in schema.arguments][:len(ins.args)]
    named = dict(zip(names, ins.args, strict=True)) | ins.kwargs
    views = any(r.alias_info is not None for r in schema.returns)
    mutated: list[int] = []
    aliased: list[int] = []
    for a in schema.arguments:
        if a.alias_info is not None and a.name in named:
            ids = list(_bufs(named[a.name]))
            mutated += ids if a.alias_info.is_write else []
            aliased += ids if views else []
    return mutated, aliased


@functools.cache
def _schema(op: str) -> torch._C.FunctionSchema | None:
    """The schema of `aten::name.overload` (None for other namespaces)."""
    ns, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    if ns != "aten":
        return None
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload or "default")._schema if packet is not None else None


def _pieces(c: Comm) -> tuple[tuple[int, ...], ...]:
    """Each member's piece of collective `c`: its input (all_gather), or the slice it receives (reduce_scatter)."""
    if c.kind == "all_gather":
        return c.shapes
    width = len(c.shapes)
    return tuple(tuple(chunk(n, width, r)[1] if d == c.dim else n for d, n in enumerate(s))
                 for r, s in enumerate(c.shapes))


def _rewrite(instrs: tuple[Instr, ...], buckets: list[_Bucket], coords: tuple[int, ...]) -> tuple[Instr, ...]:
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
        shapes = tuple(c.shapes[coords[c0.mdim]] for c in comms)  # type: ignore[union-attr]
        split = c0.kind != "all_reduce"
        dims = tuple(c.dim for c in comms) if split else ()  # type: ignore[union-attr]
        groups = tuple(_pieces(c) for c in comms) if split else ()  # type: ignore[arg-type]
        starts.setdefault(b.start_at, []).append(Start(srcs, outs, c0.mdim, c0.op, c0.dtype, shapes, c0.kind, dims,
                                                       groups))
        waits.setdefault(b.wait_at, []).append(Wait(outs))
        moved.update(b.members)
    out: list[Instr] = list(starts.get(-1, []))
    for i, ins in enumerate(instrs):
        out.extend(waits.get(i, []))
        if i not in moved:
            out.append(ins)
        out.extend(starts.get(i, []))
    out.extend(waits.get(len(instrs), []))
    return tuple(out)
