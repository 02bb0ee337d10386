"""`CommDebugMode` (torch.distributed.tensor.debug's name): the collectives monarch ships inside a block.

Counts are keyed as DTensor's (the torch.ops.c10d_functional op of each collective) and, a monarch extra,
by mesh dim (`get_comm_counts_by_dim`); `collectives` lists them in order, as `all_reduce[dp]`.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the torch.ops.c10d_functional keys

from monarch.runtime.session.session import Session, all_sessions

OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
       "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}  # monarch kind -> c10d op
KEYS = {kind: getattr(torch.ops.c10d_functional, op) for kind, op in OPS.items()}  # DTensor's keys
ALIASES = {**{op: KEYS[kind] for kind, op in OPS.items()},
           **{getattr(torch.ops._c10d_functional, op): KEYS[kind] for kind, op in OPS.items()}}
_NAME = re.compile(r"(\w+)\[(\w+)\]")


class CommCounts(dict):
    """Collective counts keyed by torch.ops.c10d_functional op, 0 for an op not shipped (as DTensor's
    defaultdict); also looked up by the native torch.ops._c10d_functional op or by the op's name."""

    def __missing__(self, key: Any) -> int:
        alias = ALIASES.get(key)
        return dict.get(self, alias, 0) if alias is not None else 0


class CommDebugMode:
    """`with CommDebugMode() as comm:` counts the collectives shipped while the block runs. Ops recorded
    before the block are shipped at its start (they are not counted), those recorded in it at its end."""

    def __init__(self) -> None:
        self.collectives: list[str] = []
        self._start: dict[Session, int] = {}

    def __enter__(self) -> CommDebugMode:
        self.collectives = []
        self._start = {s: len(s.collectives) for s in _shipped()}
        return self

    def __exit__(self, *exc: object) -> None:
        sessions = _shipped() if exc[0] is None else [s for s in all_sessions() if s in self._start]
        for s in sessions:
            self.collectives += s.collectives[self._start.get(s, 0):]
        self._start = {}

    def get_total_counts(self) -> int:
        return len(self.collectives)

    def get_comm_counts(self) -> CommCounts:
        counts = CommCounts()
        for kind, _ in map(_split, self.collectives):
            counts[KEYS[kind]] = counts.get(KEYS[kind], 0) + 1
        return counts

    def get_comm_counts_by_dim(self) -> dict[str, Counter[str]]:
        """{mesh dim: {"all_reduce": n, ...}}: which mesh dims the collectives ran over."""
        out: dict[str, Counter[str]] = {}
        for kind, dim in map(_split, self.collectives):
            out.setdefault(dim, Counter())[kind] += 1
        return out


def _split(name: str) -> tuple[str, str]:
    """`all_reduce[dp]` -> ("all_reduce", "dp")."""
    m = _NAME.fullmatch(name)
    assert m is not None and m.group(1) in OPS, f"unknown collective name {name!r}"
    return m.group(1), m.group(2)


def _shipped() -> list[Session]:
    """Every session of a running mesh, its pending ops shipped first (so their collectives are known)."""
    out = []
    for s in all_sessions():
        if s.live and not s.capturing:
            if s.tracer.n_ops:
                s.flush()
            out.append(s)
    return out
