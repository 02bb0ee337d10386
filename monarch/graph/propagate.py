"""Sharding propagation: for one op call, the input and output placements on every mesh dim.

Each mesh dim is decided on its own: of the rule's strategies (plus "all replicated"), the one whose
input redistributions move the fewest bytes (`redistribute.cost`) wins; ties go to fewer redistribution
steps, then to a sharded output, then to a Partial one. An op with no rule runs replicated, with a
one-time warning (an UnsupportedOpError under MONARCH_STRICT=1), counted per op name (`fallback_counts`).
"""
from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from monarch import config
from monarch.errors import UnsupportedOpError
from monarch.graph.redistribute import cost, direct_kind
from monarch.graph.rules.table import Emitter, OpCall, Rule, Strategy, all_replicated, rule_for, writes_first_arg
from monarch.shape import Extent
from monarch.tensor.placement import Partial, R, Shard
from monarch.tensor.spec import Spec

_warned: set[str] = set()
_fallbacks: Counter[str] = Counter()  # op name -> decisions that fell back
_POINT = Extent(("point",), (1,))  # a mesh dim of size 1
_INTERNAL = tuple(str(Path(f).parent) + os.sep for f in (torch.__file__, config.__file__))  # torch/, monarch/


@dataclass(frozen=True)
class Decision:
    """Chosen placements for one call: inputs after redistribution, outputs, and the local emitter."""
    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    strategies: tuple[Strategy, ...]  # one per mesh dim
    emit: Emitter | None


def decide(call: OpCall) -> Decision:
    rule = rule_for(call.op)
    if rule is None:
        return _fallback(call)
    inplace = writes_first_arg(call.op)
    if call.ins and not len(call.ins[0].mesh):
        return _one_rank(call, rule, inplace)
    chosen = tuple(_best(call, d, rule(call, d), inplace) for d in range(len(call.ins[0].mesh) if call.ins else 0))
    ins = tuple(s.with_placements(tuple(c.inputs[i] for c in chosen)) for i, s in enumerate(call.ins))
    outs = tuple(s.with_placements(tuple(c.outputs[i] for c in chosen)) for i, s in enumerate(call.outs))
    emit = next((c.emit for c in chosen if c.emit is not None), None)
    return Decision(ins, outs, chosen, emit)


def _one_rank(call: OpCall, rule: Rule, inplace: bool) -> Decision:
    """A mesh without dims is one rank: nothing to place, but the op's emitter (a random op's seeded
    draw, empty_like's zeros) is the one the rule picks on a mesh dim of size 1, where pieces are whole."""
    def lift(spec: Spec) -> Spec:
        return Spec(spec.shape, spec.stride, spec.dtype, (R,), _POINT)
    lifted = replace(call, ins=tuple(map(lift, call.ins)), outs=tuple(map(lift, call.outs)))
    return Decision(call.ins, call.outs, (), _best(lifted, 0, rule(lifted, 0), inplace).emit)


def _best(call: OpCall, d: int, strategies: list[Strategy], inplace: bool) -> Strategy:
    best, best_key = None, None
    for i, s in enumerate([*strategies, all_replicated(call)]):
        key = _key(call, d, s, i, inplace)
        if key is not None and (best_key is None or key < best_key):
            best, best_key = s, key
    assert best is not None
    return best


def _key(call: OpCall, d: int, s: Strategy, order: int, inplace: bool) -> tuple[int, float, int, int, int] | None:
    """Sort key of strategy `s` on mesh dim d, or None when it does not fit the inputs.

    An in-place op first of all keeps its target's placement (a parameter updated by a Partial
    gradient stays replicated: the gradient is reduced, not the parameter made Partial)."""
    nbytes, changes = 0.0, 0
    for spec, want in zip(call.ins, s.inputs, strict=True):
        have = spec.placements[d]
        if isinstance(want, Shard) and not 0 <= want.dim < spec.ndim:
            return None
        if have != want:
            changes += 1
            nbytes += cost(direct_kind(have, want), spec, d)
    out = s.outputs[0] if s.outputs else None
    rank = 0 if isinstance(out, Shard) else 1 if isinstance(out, Partial) else 2
    keep = call.ins[0].placements[d] if inplace else None
    moves_target = int(inplace and (s.inputs[0] != keep or s.outputs[0] != keep))
    return (moves_target, nbytes, changes, rank, order)


def _fallback(call: OpCall) -> Decision:
    name = call.name
    if config.strict():
        raise UnsupportedOpError(f"{name}: no sharding rule (inputs {list(call.ins)}); register one with "
                                 "@register_rule in monarch/graph/rules/<family>.py, or unset MONARCH_STRICT to "
                                 "run it replicated")
    _fallbacks[name] += 1
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"monarch: {name} has no sharding rule; its inputs are gathered and it runs replicated "
                      "(MONARCH_STRICT=1 makes this an error)", stacklevel=_user_stacklevel())
    s = all_replicated(call)
    ndim = len(call.ins[0].mesh) if call.ins else 0
    ins = tuple(spec.with_placements(tuple(s.inputs[i] for _ in range(ndim))) for i, spec in enumerate(call.ins))
    outs = tuple(spec.with_placements(tuple(s.outputs[i] for _ in range(ndim))) for i, spec in enumerate(call.outs))
    return Decision(ins, outs, (s,) * ndim, None)


def fallback_counts() -> dict[str, int]:
    """A copy of how many op decisions of each name fell back to gather-and-replicate in this process."""
    return dict(_fallbacks)


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first caller outside monarch and torch: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
