"""The Python state a compiled step reads besides its arguments: found while the step is recorded, checked
before each replay.

While a step is recorded, torch's global hooks report each optimizer whose `step` runs and each module
whose forward runs, and the tracer reports each MeshTensor read from outside the step. Their state at first
sight (an optimizer's hyperparameters and Python-side state, a module's plain attributes and mode, whether
a parameter's `.grad` is None) becomes the program's `Guards`; state the step changes in Python while it is
recorded would not change on a replay, and is refused. Adam's step counts move to the workers (capturable).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim import adam as torch_adam
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from monarch.errors import TraceError
from monarch.graph.trace import SCALARS
from monarch.tensor.meshtensor import MeshTensor

CONSTANTS = (*SCALARS, str, type(None))  # what a program is keyed by the value of
_PLAIN = frozenset(CONSTANTS)  # their exact types: a set lookup is the fast path of the checks before each call
_UNSET = "(unset)"  # an attribute a module does not have
_stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers a recorded step ran


def value(v: Any) -> Any:
    """A comparable snapshot of a hyperparameter, a module attribute or optimizer state. A MeshTensor counts
    by identity: the program reads it as an input; a plain tensor by value: the program holds a copy."""
    if type(v) in _PLAIN or isinstance(v, CONSTANTS):
        return v
    if isinstance(v, tuple):
        return tuple(value(x) for x in v)
    if isinstance(v, MeshTensor):
        return ("MeshTensor", id(v))
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), v.tolist())
    return (type(v).__name__, id(v))


def optimizer_state(opt: torch.optim.Optimizer, fed: bool = False) -> tuple[Any, Any]:
    """Its hyperparameters per group, and per parameter how many state entries it has and the Python-side
    ones (its MeshTensor state is read by the program as inputs). With `fed`, without the learning rates a
    program reads as inputs (`fed_lr`): what a replay needs to be the same."""
    groups = tuple(tuple((k, value(v)) for k, v in g.items() if k != "params" and not (fed and k in fed_keys(opt, g)))
                   for g in opt.param_groups)
    params = tuple(_param_state(opt.state.get(p)) for g in opt.param_groups for p in g["params"])
    return groups, params


def fed_keys(opt: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The hyperparameters a recorded step reads as inputs each call: the float lr of a capturable Adam
    (or AdamW) stepping one tensor at a time (torch's default on cpu), whose step takes a tensor lr, so an
    LR scheduler stepping between calls needs no new recording. (Tensor betas, or a tensor lr in the
    foreach path, would be read on the controller: a momentum schedule, or foreach=True, records anew.)"""
    plain = isinstance(opt, torch.optim.Adam) and group.get("capturable") and not group.get("foreach")
    return ("lr",) if plain and not group.get("fused") and type(group["lr"]) is float else ()


def _param_state(st: dict[str, Any] | None) -> tuple[Any, ...]:
    if not st:
        return ()
    return (len(st), *((k, value(v)) for k, v in st.items() if not isinstance(v, MeshTensor)))


def module_state(mod: torch.nn.Module) -> tuple[Any, ...]:
    """Its plain attributes (`training`, sizes, flags, scalars a forward reads)."""
    return tuple((k, v if type(v) in _PLAIN else value(v)) for k, v in vars(mod).items()
                 if type(v) in _PLAIN or isinstance(v, (*CONSTANTS, tuple)))


def _attributes(names: tuple[str, ...], mod: torch.nn.Module) -> tuple[Any, ...]:
    """module_state(mod) as a guard reads it before each call: the attributes it had (and how many)."""
    d = vars(mod)
    return len(d), tuple((k, v if type(v) in _PLAIN else value(v)) for k in names for v in (d.get(k, _UNSET),))


def _module_guard(mod: torch.nn.Module, state: tuple[Any, ...]) -> Guard:
    """Read after the step was recorded: refuse_changes checks that its state is still `state`."""
    read = functools.partial(_attributes, tuple(k for k, _ in state))
    return Guard(type(mod).__name__, weakref.ref(mod), read(mod), read)


@dataclass(frozen=True)
class Guard:
    """One object's state when the step was recorded; a replay needs the object to be in it still."""
    what: str
    ref: weakref.ref
    state: Any
    read: Callable[[Any], Any]

    def why_not(self) -> str | None:
        obj = self.ref()
        if obj is None:
            return f"{self.what} is gone"
        now = self.read(obj)
        return None if now == self.state else f"{self.what} changed: {self.state} is now {now}"


@dataclass(frozen=True)
class Guards:
    """Everything a program depends on besides its arguments' signature and the buffers it reads."""
    guards: tuple[Guard, ...]
    grads: tuple[tuple[weakref.ref, bool], ...]  # (parameter, whether it had a .grad), checked first

    def why_not(self) -> str | None:
        with torch._C.DisableTorchFunctionSubclass():  # reads .grad as torch does, without MeshTensor's hook
            for ref, had in self.grads:
                p = ref()
                if p is None or (p.grad is not None) != had:
                    return "a parameter is gone" if p is None else f"a parameter's .grad is {'None' if had else 'set'}"
        return next((why for g in self.guards if (why := g.why_not()) is not None), None)


@dataclass
class Watch:
    """Records, while a step is traced, the state it reads (at first sight): `input` is the tracer's
    callback for MeshTensors read from outside the step; leaves that need gradients are parameters, and
    whether backward accumulates into their `.grad` or makes a fresh one depends on it being None."""
    # a per-call input of the step, placed on the mesh of the tensor it meets (a parameter of the group)
    feed: Callable[[Callable[[], torch.Tensor], torch.Tensor], MeshTensor] | None = None
    optimizers: dict[int, tuple[torch.optim.Optimizer, Any, Any]] = field(default_factory=dict)
    lent: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)  # hyperparameters fed now
    modules: dict[int, tuple[torch.nn.Module, Any]] = field(default_factory=dict)
    grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # param, its .grad
    unconverted: list[torch.optim.Optimizer] = field(default_factory=list)  # Adam with step counts still here

    def input(self, t: MeshTensor) -> None:
        if t.is_leaf and t.requires_grad:
            self._params((t,))

    def _params(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self.grads.setdefault(id(p), (p, p.grad))

    def _optimizer(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        _stepped.add(opt)
        if id(opt) not in self.optimizers:
            if isinstance(opt, torch.optim.Adam) and not make_capturable(opt, convert=False):
                self.unconverted.append(opt)
            self.optimizers[id(opt)] = (opt, optimizer_state(opt), optimizer_state(opt, fed=True))
        self._params(p for g in opt.param_groups for p in g["params"])
        for g in opt.param_groups if self.feed is not None and opt not in self.unconverted else ():
            for k in fed_keys(opt, g):  # read as tensors each call brings; the floats are back after the step
                self.lent.append((g, k, g[k]))
                g[k] = self._fed(g, k)

    def _fed(self, group: dict[str, Any], key: str) -> MeshTensor:
        assert self.feed is not None
        return self.feed(functools.partial(_hyper, group, key), group["params"][0])

    def _stepped(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        for g, k, v in self.lent:
            g[k] = v
        self.lent.clear()

    def _module(self, mod: torch.nn.Module, *_: Any) -> None:
        if id(mod) not in self.modules:
            self.modules[id(mod)] = (mod, module_state(mod))

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """torch's global hooks, and zero_grad noting the gradients it clears, while the step is traced."""
        handles = [register_optimizer_step_pre_hook(self._optimizer), register_optimizer_step_post_hook(self._stepped),
                   register_module_forward_pre_hook(self._module)]
        own = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad

        def opt_zero_grad(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            self._params(p for g in opt.param_groups for p in g["params"])
            own[0](opt, *args, **kwargs)

        def module_zero_grad(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            self._params(mod.parameters())
            own[1](mod, *args, **kwargs)
        torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad = opt_zero_grad, module_zero_grad  # type: ignore
        try:
            yield
        finally:
            torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad = own  # type: ignore[method-assign]
            for h in handles:
                h.remove()

    def guards(self, arguments: set[int]) -> Guards:
        """The program's guards: the state met at first sight, and whether each parameter (not an argument,
        by `id`) had a `.grad`."""
        return Guards(
            tuple(Guard(type(o).__name__, weakref.ref(o), s, functools.partial(optimizer_state, fed=True))
                  for o, _, s in self.optimizers.values()) +
            tuple(_module_guard(m, s) for m, s in self.modules.values()),
            tuple((weakref.ref(p), g is not None) for p, g in self.grads.values() if id(p) not in arguments))

    def refuse_changes(self, step: str) -> None:
        """Raise TraceError for state the step changed in Python while it was recorded."""
        for opt, (groups, params), _ in self.optimizers.values():
            now_groups, now_params = optimizer_state(opt)
            name = type(opt).__name__
            _refuse_change(step, _groups(name, groups), _groups(name, now_groups),
                           "step LR schedulers and set hyperparameters outside the compiled step, between calls")
            if opt not in self.unconverted:
                _refuse_python_state(step, opt, params, now_params)
        for mod, state in self.modules.values():
            name = type(mod).__name__
            _refuse_change(step, [(f"{name}.{k}", v) for k, v in state],
                           [(f"{name}.{k}", v) for k, v in module_state(mod)],
                           "set module attributes and modes (train/eval) outside the compiled step")


def _groups(name: str, groups: tuple) -> list[tuple[str, Any]]:
    return [(f"{name}.param_groups[{i}][{k!r}]", v) for i, g in enumerate(groups) for k, v in g]


def _refuse_change(step: str, before: list[tuple[str, Any]], after: list[tuple[str, Any]], fix: str) -> None:
    """Raise for the first named value that differs between `before` and `after`."""
    was, now = dict(before), dict(after)
    for what in {**was, **now}:
        if was.get(what, _UNSET) != now.get(what, _UNSET):
            raise TraceError(f"{step} changed {what} from {was.get(what, _UNSET)} to {now.get(what, _UNSET)} while it "
                             "was recorded; "
                             f"a replay runs only the recorded tensor operations and would not change it again: {fix}")


def _refuse_python_state(step: str, opt: torch.optim.Optimizer, before: tuple, after: tuple) -> None:
    """State that existed before the step and that the step updated on the controller (a plain tensor)."""
    for b, a in zip(before, after, strict=True):
        if b and b != a:
            raise TraceError(f"{step}: {type(opt).__name__} keeps per-parameter state on the controller that its "
                             f"step updates ({b} -> {a}); a replay would not update it: use an optimizer whose "
                             "state is all tensors on the mesh (SGD, Adam, AdamW), or step this one eagerly, "
                             "outside the compiled step")


def known_optimizers(near: Iterable[Any]) -> Iterator[torch.optim.Optimizer]:
    """The optimizers among `near` and those a recorded step ran before."""
    yield from (o for o in near if isinstance(o, torch.optim.Optimizer))
    yield from list(_stepped)


def make_capturable(opt: torch.optim.Adam, convert: bool = True) -> bool:
    """Adam keeps its step count on the controller unless capturable; a compiled step needs it as a
    replicated MeshTensor, so that bias corrections are computed by the program, not baked into it.
    Without `convert` (while a step is recorded) nothing is created: False when there was something to."""
    from monarch.runtime.session.api import distribute_tensor
    if getattr(opt, "_monarch_steps", -1) == len(opt.state):
        return True  # every state present was converted already
    groups = [(g, [p for p in g["params"] if isinstance(p, MeshTensor)]) for g in opt.param_groups]
    plain = [(p, st) for _, params in groups for p in params
             if (st := opt.state.get(p)) and "step" in st and not isinstance(st["step"], MeshTensor)]
    if plain and not convert:
        return False
    for g, params in groups:
        if params:
            g["capturable"] = True
    for p, st in plain:
        st["step"] = distribute_tensor(st["step"].to(torch.float32), p.mesh)
    opt._monarch_steps = len(opt.state)  # type: ignore[attr-defined]
    _step_eagerly_too(opt)
    return True


def _step_eagerly_too(opt: torch.optim.Optimizer) -> None:
    """A capturable optimizer must also step outside a compiled step (eagerly, after a resume): this one
    optimizer's `step` runs under capturable_on_cpu(), other optimizers keep torch's check."""
    if "step" in vars(opt):
        return
    own = opt.step

    @functools.wraps(own)
    def step(*args: Any, **kwargs: Any) -> Any:
        with capturable_on_cpu():
            return own(*args, **kwargs)
    opt.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """The hook under which a step is recorded: capturable Adam (and AdamW) checks that parameters and
    step counts are on a device `torch.optim.adam._get_capturable_supported_devices()` names, and
    MeshTensors report cpu (their step counts are MeshTensors that make_capturable made). While the
    step runs, that function also names cpu; torch's own is put back after, also when the step raises."""
    own = torch_adam._get_capturable_supported_devices

    def supported(*a: Any, **kw: Any) -> list[str]:
        return [*own(*a, **kw), "cpu"]
    torch_adam._get_capturable_supported_devices = supported  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_adam._get_capturable_supported_devices = own


def _hyper(group: dict[str, Any], key: str) -> torch.Tensor:
    """A group's hyperparameter now, as the tensor a call of the recorded step brings."""
    return torch.tensor(group[key], dtype=torch.float64, device="cpu")
