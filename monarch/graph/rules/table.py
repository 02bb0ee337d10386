"""The sharding rule table: one entry per aten op, filled by `@register_rule` in one module per op family
(`graph/rules/<family>.py`; importing `monarch.graph.rules` imports every family once).

A rule looks at one op call (global input and output specs, arguments) and one mesh dim, and lists
the strategies that are valid on that dim: a placement per tensor input and per output. Propagation
picks, per mesh dim, the strategy that moves the fewest bytes; "everything replicated" is always valid
and need not be listed. A strategy may carry an emitter when the local kernel differs from the op.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from monarch.program.instr import Buf, Local
from monarch.tensor.placement import Placement, R
from monarch.tensor.spec import Spec

OpOverload = torch._ops.OpOverload


@dataclass(frozen=True)
class OpCall:
    """One recorded op as rules see it: tensors are replaced by their Specs (`Spec` in args)."""
    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ins: tuple[Spec, ...]   # tensor inputs, flattened in argument order
    outs: tuple[Spec, ...]  # outputs (placements not chosen yet: all R)

    @property
    def name(self) -> str:
        return str(self.op.name()).removeprefix("aten::")

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument i, else keyword `name`, else `default`."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)


@dataclass
class Emit:
    """Context for emitting one rank's local instructions for an op."""
    call: OpCall
    ins: tuple[Spec, ...]    # input specs after redistribution
    outs: tuple[Spec, ...]   # chosen output specs
    coords: tuple[int, ...]
    args: tuple[Any, ...]    # Buf in place of tensors
    kwargs: dict[str, Any]
    out_ids: tuple[int, ...]
    fresh: Callable[[], int]
    seed: int = 0            # drawn when a random op was recorded (monarch.manual_seed)

    def default(self) -> list[Local]:
        return [Local(op_name(self.call.op), self.args, self.kwargs, self.out_ids)]

    def local_out_shape(self, i: int = 0) -> tuple[int, ...]:
        return self.outs[i].local_shape(self.coords)

    def tmp(self) -> Buf:
        return Buf(self.fresh())


Emitter = Callable[[Emit], list[Local]]


@dataclass(frozen=True)
class Strategy:
    """Placements on one mesh dim: one per tensor input, one per output, and an optional emitter."""
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    emit: Emitter | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"({', '.join(map(repr, self.inputs))}) -> ({', '.join(map(repr, self.outputs))})"


Rule = Callable[[OpCall, int], list[Strategy]]
RULES: dict[OpOverload, Rule] = {}


def register_rule(*ops: OpOverload | Iterable[OpOverload]) -> Callable[[Rule], Rule]:
    """Register `rule` for each op (OpOverloads, or OpOverloadPackets meaning all their overloads)."""
    def deco(rule: Rule) -> Rule:
        for op in _expand(ops):
            RULES[op] = rule
        return rule
    return deco


def _expand(ops: Iterable[Any]) -> Iterable[OpOverload]:
    for op in ops:
        if isinstance(op, OpOverload):
            yield op
        elif isinstance(op, torch._ops.OpOverloadPacket):
            yield from (getattr(op, o) for o in op.overloads())
        else:
            yield from _expand(op)


def op_name(op: OpOverload) -> str:
    """`aten::add.Tensor`, `aten::mm`: the name a worker resolves back to the op."""
    return str(op.name())


def writes_first_arg(op: OpOverload) -> bool:
    """In-place ops (`add_`, `copy_`, `fill_`) write their first argument and return it."""
    args = op._schema.arguments
    a = args[0].alias_info if args else None
    return a is not None and a.is_write


def all_replicated(call: OpCall) -> Strategy:
    return Strategy(tuple(R for _ in call.ins), tuple(R for _ in call.outs))


def rule_for(op: OpOverload) -> Rule | None:
    return RULES.get(op)
