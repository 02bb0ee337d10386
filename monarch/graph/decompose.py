"""Decompositions: ops without a sharding rule recorded as several simpler ops that have one.

`_foreach_*` ops run as one plain op per element; batch and group norm as the reductions of `norms.py`;
any other op as torch's decomposition (its table, or its CompositeImplicit kernel) when a dry run on fake
tensors shows that every op it reaches has a rule (or such a decomposition itself, a few levels deep).
The outputs of an op that aliases nothing are its own, even where its decomposition ends in a view.
"""
from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch._decomp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from monarch import config
from monarch.errors import UnsupportedOpError
from monarch.graph.norms import NORMS
from monarch.graph.rules.table import rule_for
from monarch.graph.trace import Value
from monarch.tensor.meshtensor import MeshTensor

OpOverload = torch._ops.OpOverload
MAX_DEPTH = 6   # decompositions inside decompositions
MAX_OPS = 96    # a decomposition recording more ops than this is too slow to be worth it (a Python loop)
EXCLUDED = frozenset({"aten::_to_copy", "aten::lift_fresh", "aten::detach"})  # recorded as they are
_depth = contextvars.ContextVar("monarch_decompose_depth", default=0)
_refused: contextvars.ContextVar[frozenset[OpOverload]] = contextvars.ContextVar("monarch_decompose_refused",
                                                                                 default=frozenset())
Decomposition = Callable[..., Any]


def decomposition(op: OpOverload) -> Decomposition | None:
    """How to run `op` as simpler ops, or None when it is recorded as it is."""
    if op in _refused.get() or rule_for(op) is not None or _depth.get() + int(not _implicit(op)) > MAX_DEPTH:
        return None
    own = NORMS.get(op)
    return functools.partial(_own, own) if own is not None else _foreach(op) or _generic(op)


def _own(fn: Decomposition, *args: Any, **kwargs: Any) -> Any:
    with _deeper(1):
        return fn(*args, **kwargs)


@functools.cache
def _generic(op: OpOverload) -> Decomposition | None:
    fn = _torch_decomposition(op)
    return None if fn is None else functools.partial(_checked, op, fn)


@functools.cache
def _torch_decomposition(op: OpOverload) -> Decomposition | None:
    if _implicit(op):
        return op.decompose  # what torch itself runs it as (e.g. reshape, to.dtype reaching a tensor subclass)
    fn = torch._decomp.decomposition_table.get(op)
    return fn if fn is not None and _decomposable(op) else None


@functools.cache
def _implicit(op: OpOverload) -> bool:
    """torch runs `op` as other ops itself (a CompositeImplicitAutograd kernel)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _returns_views(op: OpOverload) -> bool:
    return any(r.alias_info is not None for r in op._schema.returns)


def _decomposable(op: OpOverload) -> bool:
    """Ops whose decomposition keeps their meaning on a mesh: tensor results, no views (a view must alias
    its base), no random draws (their numbers come from monarch's own seeded stream)."""
    returns = op._schema.returns
    if not returns or str(op._schema.name) in EXCLUDED or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if any(not isinstance(r.type, torch.TensorType) for r in returns):
        return False
    return all(r.alias_info is None or r.alias_info.is_write for r in returns)


def _checked(op: OpOverload, fn: Decomposition, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` on the MeshTensors when its dry run is covered by rules, else record `op` as it is."""
    missing = _dry_run(op, fn, args, kwargs)
    if missing is None:
        with _deeper(int(not _implicit(op))):
            out = fn(*args, **kwargs)
        return out if _returns_views(op) else _owned(out)
    if config.strict():
        raise UnsupportedOpError(f"{op.name()}: no sharding rule, and its decomposition needs {missing}, which has "
                                 "none; register one with @register_rule in monarch/graph/rules/<family>.py, or "
                                 "unset MONARCH_STRICT to run it replicated")
    token = _refused.set(_refused.get() | {op})
    try:
        return op(*args, **kwargs)
    finally:
        _refused.reset(token)


def _owned(result: Any) -> Any:
    """`result` of a non-aliasing op run as a decomposition ending in a view (repeat's last reshape): it views
    only temporaries, so a write through it loses nothing even where they had to move."""
    for t in tree_leaves(result):
        if type(t) is MeshTensor and isinstance(t._handle, Value):
            t._handle.copied_view = False
    return result


@contextmanager
def _deeper(step: int) -> Iterator[None]:
    token = _depth.set(_depth.get() + step)
    try:
        yield
    finally:
        _depth.reset(token)


def _dry_run(op: OpOverload, fn: Decomposition, args: tuple, kwargs: dict) -> str | None:
    """What the decomposition reaches that has neither a rule nor a usable decomposition (None: nothing),
    found by running it on fake tensors of the same shapes."""
    key = _signature(op, args, kwargs)
    if key is not None and key in _verdicts:
        return _verdicts[key]
    probe = _Probe(op)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            fake_args, fake_kwargs = _fake(args), _fake(kwargs)
        with fake, probe:
            if fn(*fake_args, **fake_kwargs) is NotImplemented:
                probe.missing = probe.missing or f"{op.name()} (its decomposition declines these arguments)"
    except Exception as e:  # noqa: BLE001 - the decomposition cannot run on these arguments
        probe.missing = probe.missing or f"{op.name()} (its decomposition fails: {type(e).__name__}: {str(e)[:80]})"
    if probe.ops > MAX_OPS:
        probe.missing = f"{op.name()} (its decomposition records {probe.ops} ops, over {MAX_OPS})"
    if key is not None:
        _verdicts[key] = probe.missing
    return probe.missing


_verdicts: dict[Any, str | None] = {}  # dry-run outcome by call signature (one entry per op and shapes seen)


class _Probe(TorchDispatchMode):
    """Follows a decomposition on fake tensors: ops with rules run, the others decompose again."""

    def __init__(self, op: OpOverload) -> None:
        super().__init__()
        self.missing: str | None = None
        self.ops = 0
        self.depth = _depth.get() + int(not _implicit(op))  # inside the decomposition being tried

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if (rule_for(func) is not None or not _takes_tensors(args, kwargs) or self.missing is not None
                or func.namespace == "prim"):  # prim::device, prim::layout: reading a tensor's metadata
            return func(*args, **kwargs)
        inner = NORMS.get(func) or _foreach(func) or _torch_decomposition(func)
        step = int(not _implicit(func))  # torch's own CompositeImplicit kernels do not count as a level
        if inner is None or self.depth + step > MAX_DEPTH:
            self.missing = self.missing or str(func.name())
            return func(*args, **kwargs)
        self.depth += step
        try:
            with self:
                out = inner(*args, **kwargs)
        finally:
            self.depth -= step
        if out is NotImplemented:
            self.missing = self.missing or f"{func.name()} (its decomposition declines these arguments)"
            return func(*args, **kwargs)
        return out


def _takes_tensors(args: tuple, kwargs: dict) -> bool:
    found: list[bool] = []
    tree_map(lambda x: found.append(isinstance(x, torch.Tensor)), (args, kwargs))
    return any(found)


def _fake(obj: Any) -> Any:
    """`obj` with every tensor (MeshTensor or plain) replaced by an empty tensor of its global layout, made
    under a FakeTensorMode (no data; the device the tensor names, as decompositions branching on it see it)."""
    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return tree_map(one, obj)


def _signature(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """A hashable key of the call's shapes, dtypes and other arguments (None: some argument is unhashable)."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.stride(), x.dtype)
        return x
    try:
        key = (op, tree_map(one, (args, tuple(sorted(kwargs.items())))))
        hash(key)
    except TypeError:
        return None
    return key


@functools.cache
def _foreach(op: OpOverload) -> Decomposition | None:
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
