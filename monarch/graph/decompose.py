"""Decompositions: ops recorded as several simpler ops instead of having a sharding rule of their own.

The `_foreach_*` ops of the optimizers take lists of tensors, each with its own placements; they run as
one plain op per element (list arguments are zipped, the others shared), so every element gets the
placements its own rule picks.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def decomposition(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """How to run `op` as simpler ops, or None when it is recorded as it is."""
    name = op._schema.name.removeprefix("aten::")
    if not name.startswith("_foreach_"):
        return None
    base = getattr(torch.ops.aten, name.removeprefix("_foreach_"), None)
    if base is None:
        return None
    inplace = name.endswith("_")
    args = op._schema.arguments
    known = {a.name for o in base.overloads() for a in getattr(base, o)._schema.arguments}
    names = tuple(_name_in_base(a.name, known) if i else None for i, a in enumerate(args))
    lists = frozenset(i for i, a in enumerate(args) if isinstance(a.type, torch.ListType))
    return functools.partial(_per_element, base, inplace, lists, names)


def _name_in_base(name: str, known: set[str]) -> str | None:
    """The keyword a foreach argument has in the plain op (None: pass it by position)."""
    if name in known:
        return name
    if name in ("scalar", "scalars") and "value" in known:
        return "value"
    return None


def _per_element(base: Any, inplace: bool, lists: frozenset[int], names: tuple[str | None, ...],
                 *args: Any, **kwargs: Any) -> Any:
    n = len(args[min(lists)])
    results = []
    for k in range(n):
        pos, kw = [], dict(kwargs)
        for i, a in enumerate(args):
            v = a[k] if i in lists else a
            name = names[i]
            if name is None:
                pos.append(v)
            else:
                kw[name] = v
        results.append(base(*pos, **kw))
    return None if inplace else results
