"""Module-level parallelism on a mesh: `parallelize_module` with its styles, `data_parallel`, `full_state_dict`
(and a load_state_dict pre-hook that gathers MeshTensors of another mesh before they are copied in).

Parameters and buffers become MeshTensors in place (an nn.Parameter keeps wrapping each one), so
autograd, optimizers and `state_dict()` work unchanged. A style (as in PyTorch's tensor parallel API,
with the mesh dim named) places a module's parameters over its dim and redistributes the module's inputs
and outputs there with forward hooks; other mesh dims are left as they are, so styles compose with data
parallelism; every tensor no style covers is replicated.
"""
from __future__ import annotations

import abc
import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from monarch.errors import MeshError, ShardingError
from monarch.runtime.control.futures import Future
from monarch.runtime.session.api import distribute_tensor, fetch
from monarch.runtime.session.session import session_of
from monarch.runtime.session.torch_state import on_mesh_of
from monarch.shape import MeshLike
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement, Replicate, Shard, normalize

Memo = dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(old tensor) -> (old, its MeshTensor replacement)


def on_dim(t: Any, dim: str, placement: Placement | None) -> Any:
    """`t` redistributed to `placement` over mesh dim `dim`, the other mesh dims unchanged (differentiable).

    Anything that is not a MeshTensor, and any tensor when `placement` is None, comes back as it is."""
    if placement is None or not isinstance(t, MeshTensor) or (isinstance(placement, Shard) and t.ndim == 0):
        return t
    names = t.spec.mesh.labels
    target = list(t.placements)
    target[names.index(dim)] = placement
    target_t = normalize(target, names, t.ndim, f"redistribute over {dim!r}")
    if target_t == t.placements:
        return t
    return t.redistribute(target_t)


def check_dim(dim: str, names: Sequence[str], what: str) -> None:
    """MeshError unless `dim` names a dim of the mesh."""
    if dim not in names:
        raise MeshError(f"{what}: the mesh has no dim {dim!r} (its dims are {list(names)}); pass dim= one of them")


@dataclass(frozen=True)
class ParallelStyle(abc.ABC):
    """Base of the styles: `dim` names the mesh dim; `input_layout`/`output_layout` (None: leave as is)
    are the placements a module's tensor inputs and outputs are redistributed to over that dim."""
    dim: str = "tp"
    input_layout: Placement | None = None
    output_layout: Placement | None = None
    supports: ClassVar[tuple[type[nn.Module], ...]] = (nn.Module,)

    @abc.abstractmethod
    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement over `dim` of each of the module's own parameters this style decides."""

    def input_placement(self, module: nn.Module) -> Placement | None:
        return self.input_layout

    def check(self, name: str, module: nn.Module, names: Sequence[str]) -> None:
        """Errors naming the module when the dim is unknown or the module type is not supported."""
        check_dim(self.dim, names, f"{self!r} on module {name!r}")
        if not isinstance(module, self.supports):
            kinds = " and ".join(f"nn.{c.__name__}" for c in self.supports)
            raise ShardingError(
                f"{type(self).__name__}(dim={self.dim!r}) cannot shard module {name!r} "
                f"({type(module).__name__}): it supports {kinds}. Use SequenceParallel for norm or dropout "
                "layers, or leave the module out of the plan to replicate its parameters")

    def install(self, module: nn.Module) -> None:
        """Forward hooks redistributing the module's tensor inputs and outputs over `dim`."""
        inp = self.input_placement(module)
        if inp is not None:
            module.register_forward_pre_hook(
                lambda mod, args: tree_map_only(MeshTensor, lambda t: on_dim(t, self.dim, inp), args))
        if self.output_layout is not None:
            module.register_forward_hook(
                lambda mod, args, out: tree_map_only(MeshTensor, lambda t: on_dim(t, self.dim, self.output_layout),
                                                     out))


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """nn.Linear: weight (out, in) and bias sharded on the output features; nn.Embedding: weight sharded on
    the embedding dim. Inputs of a Linear are made Replicate; the output stays sharded on its last dim."""
    input_layout: Placement | None = Replicate()
    supports: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear, nn.Embedding)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        return {"weight": Shard(0), **({"bias": Shard(0)} if module.bias is not None else {})}

    def input_placement(self, module: nn.Module) -> Placement | None:
        return None if isinstance(module, nn.Embedding) else self.input_layout


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """nn.Linear: weight sharded on the input features, bias replicated, inputs made Shard(-1);
    nn.Embedding: weight sharded on the vocabulary. The output (a Partial sum over `dim`) is
    redistributed to `output_layout`: Replicate() by default (one all_reduce), Shard(1) for sequence
    parallelism (a reduce_scatter), or None to keep it Partial."""
    input_layout: Placement | None = Shard(-1)
    output_layout: Placement | None = Replicate()
    supports: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear, nn.Embedding)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        return {"weight": Shard(1), **({"bias": Replicate()} if module.bias is not None else {})}

    def input_placement(self, module: nn.Module) -> Placement | None:
        return None if isinstance(module, nn.Embedding) else self.input_layout


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Any module (layer norm, dropout): its own parameters replicated over `dim`, its inputs sharded on
    the sequence dim (`input_layout`, Shard(1) by default), so its outputs stay sharded there."""
    input_layout: Placement | None = Shard(1)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Replicate() for name, _ in module.named_parameters(recurse=False)}


# -- the API ------------------------------------------------------------------------------------
def parallelize_module(module: nn.Module, mesh: MeshLike, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Shard `module` over `mesh` in place following `plan` and return it.

    `plan` maps fnmatch patterns over `module.named_modules()` names to styles (ColwiseParallel,
    RowwiseParallel, SequenceParallel). Each style places the parameters of the modules it matches over
    its mesh dim and keeps the other dims as they are; every other parameter and buffer becomes a
    replicated MeshTensor (or stays the MeshTensor it already is). Build optimizers afterwards."""
    names = session_of(mesh).abstract.labels
    memo: Memo = {}
    for name, sub, style in _matches(module, plan):
        style.check(name, sub, names)
        for pname, placement in style.param_placements(sub).items():
            _place(sub, pname, _qualname(name, pname), mesh, {style.dim: placement}, memo)
        style.install(sub)
    _adopt(module, mesh, {}, memo)
    return module


def data_parallel(module: nn.Module, mesh: MeshLike, dim: str = "dp") -> nn.Module:
    """Replicate `module`'s parameters and buffers over mesh dim `dim` in place and shard its inputs there.

    A forward pre-hook turns plain tensor inputs into MeshTensors sharded on their first (batch) dim
    over `dim` and redistributes MeshTensor inputs to Shard(0) there. Gradients need no averaging:
    a mean loss over the sharded batch is the global mean, as in single-process torch."""
    check_dim(dim, session_of(mesh).abstract.labels, f"data_parallel({type(module).__name__})")
    _adopt(module, mesh, {dim: Replicate()}, {})
    module.register_forward_pre_hook(partial(_shard_batch, mesh, dim), with_kwargs=True)
    return module


def full_state_dict(obj: nn.Module | torch.optim.Optimizer, timeout: float | None = None) -> dict[str, Any]:
    """`obj.state_dict()` (a module's or an optimizer's) with every MeshTensor gathered to a plain tensor."""
    futures = tree_map_only(MeshTensor, fetch, obj.state_dict())
    return tree_map_only(Future, lambda f: f.get(timeout), futures)


# -- placing tensors ----------------------------------------------------------------------------
def _matches(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, submodule, style) for every submodule a plan pattern matches; each pattern must match one."""
    modules = dict(module.named_modules())
    owner: dict[str, str] = {}
    found = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ShardingError(f"parallelize_module: plan[{pattern!r}] is {style!r}, not a style; use "
                                "monarch.ColwiseParallel(dim=...), RowwiseParallel(...) or SequenceParallel(...)")
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            sample = [n for n in modules if n][:8]
            raise ShardingError(f"parallelize_module: plan pattern {pattern!r} matches no submodule of "
                                f"{type(module).__name__} (names look like {sample}); patterns are fnmatch "
                                "patterns over module.named_modules() names, e.g. 'blocks.*.mlp.fc1'")
        for n in hits:
            if n in owner:
                raise ShardingError(f"parallelize_module: module {n!r} is matched by plan patterns {owner[n]!r} "
                                    f"and {pattern!r}; make the patterns match disjoint modules")
            owner[n] = pattern
            found.append((n, modules[n], style))
    return found


def _adopt(module: nn.Module, mesh: MeshLike, dims: dict[str, Placement], memo: Memo) -> None:
    """Every parameter and buffer of `module` on the mesh: plain ones replicated, MeshTensors with `dims`."""
    for mname, sub in module.named_modules():
        for pname, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is None:
                continue
            if id(t) in memo or not isinstance(t, MeshTensor) or dims:
                _place(sub, pname, _qualname(mname, pname), mesh, dims, memo)
            else:
                _check_mesh(t, mesh, _qualname(mname, pname))
    if not getattr(module, "_monarch_loads", False):
        module.register_load_state_dict_pre_hook(_gather_foreign)
        module._monarch_loads = True


def _gather_foreign(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: a MeshTensor value not on its target's mesh is gathered first (copy_ then
    places it like the target; the optimizer's counterpart is monarch.runtime.session.torch_state)."""
    for name, target in module.state_dict(keep_vars=True).items():
        value = state_dict.get(prefix + name)
        if isinstance(value, MeshTensor) and not on_mesh_of(value, target):
            state_dict[prefix + name] = value.full_tensor()


def _place(module: nn.Module, pname: str, qualname: str, mesh: MeshLike, dims: dict[str, Placement],
           memo: Memo) -> None:
    """Replace the module's tensor `pname` by a MeshTensor placed as `dims` over their mesh dims
    (Replicate on the others for a plain tensor; a MeshTensor keeps its other dims). Shared tensors
    (tied weights) are converted once and must not get two different placements."""
    old = module._parameters[pname] if pname in module._parameters else module._buffers[pname]
    assert old is not None, f"{qualname} is None"
    if id(old) in memo:
        new = memo[id(old)][1]
        _check_same(new, dims, qualname)
    else:
        new = _to_mesh(old, mesh, dims, qualname)
        memo[id(old)] = (old, new)
    if pname in module._parameters:
        assert isinstance(new, nn.Parameter), f"{qualname}: {type(new)}"
        module._parameters[pname] = new
    else:
        module._buffers[pname] = new


def _to_mesh(t: torch.Tensor, mesh: MeshLike, dims: dict[str, Placement], qualname: str) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(t, MeshTensor):
            _check_mesh(t, mesh, qualname)
            names = t.spec.mesh.labels
            target = list(t.placements)
            for dim, p in dims.items():
                target[names.index(dim)] = p
            out = t.redistribute(target)
        else:
            out = distribute_tensor(t.detach(), mesh, dims)
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _check_mesh(t: MeshTensor, mesh: MeshLike, qualname: str) -> None:
    if t._backend is not session_of(mesh):
        raise MeshError(f"{qualname} is a MeshTensor on {t.mesh!r}, not on {mesh!r}; parallelize on the mesh it "
                        "lives on, or turn it into a plain tensor first (.full_tensor())")


def _check_same(t: torch.Tensor, dims: dict[str, Placement], qualname: str) -> None:
    """A tensor shared by several modules gets one placement: the second style must agree with the first."""
    assert isinstance(t, MeshTensor)
    names = t.spec.mesh.labels
    for dim, p in dims.items():
        have = t.placements[names.index(dim)]
        if have != p:
            raise ShardingError(f"{qualname} is shared with another module that placed it {have} over {dim!r}; "
                                f"a style here asks for {p}. Give tied weights the same placement over {dim!r}")


def _qualname(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


# -- inputs ------------------------------------------------------------------------------------
def _shard_batch(mesh: MeshLike, dim: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of data_parallel: tensor inputs sharded on their first dim over `dim`."""
    def shard(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return t
        if isinstance(t, MeshTensor):
            return on_dim(t, dim, Shard(0))
        return distribute_tensor(t, mesh, {dim: Shard(0)})
    return tree_map_only(torch.Tensor, shard, (args, kwargs))
