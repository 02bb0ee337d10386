"""Module-level parallelism on a mesh: `parallelize_module`, `distribute_module`, `data_parallel`,
`full_state_dict` (and a load_state_dict pre-hook that gathers MeshTensors of another mesh before they are
copied in).

Parameters and buffers become MeshTensors in place (an nn.Parameter keeps wrapping each one), so
autograd, optimizers and `state_dict()` work unchanged. Styles (monarch.parallel.styles) place a module's
parameters over one mesh dim and keep the other dims as they are, so they compose with data parallelism;
every tensor no style covers is replicated.
"""
from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Union, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from monarch.errors import MeshError, ShardingError
from monarch.parallel.layouts import MeshDim, check_dim, on_dim
from monarch.parallel.styles import ParallelStyle
from monarch.runtime.control.futures import Future
from monarch.runtime.session.api import distribute_tensor, fetch
from monarch.runtime.session.session import session_of
from monarch.runtime.session.torch_state import on_mesh_of
from monarch.shape import MeshLike, SubMesh, default_mesh
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement, Replicate, Shard

Memo = dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(old tensor) -> (old, its MeshTensor replacement)
Plan = Union[ParallelStyle, Mapping[str, ParallelStyle]]
TpMesh = Union[MeshLike, SubMesh, tuple[MeshLike, str]]  # a mesh, a view mesh["tp"], or (mesh, dim name)
PartitionFn = Callable[[str, nn.Module, Any], None]
HookFn = Callable[[nn.Module, Any, Any], Any]


# -- the API ------------------------------------------------------------------------------------
def parallelize_module(module: nn.Module, device_mesh: TpMesh | None = None, parallelize_plan: Plan | None = None
                       ) -> nn.Module:
    """Shard `module` over `device_mesh` in place following `parallelize_plan` and return it.

    The plan is a style (applied to `module` itself) or a dict from fnmatch patterns over
    `module.named_modules()` names to styles. `device_mesh` is a mesh with one dim, a view `mesh["tp"]` of
    a larger mesh, `(mesh, dim name)`, or None (the mesh of the innermost `with mesh:` block): a style
    without `dim=` works on that dim; on a mesh of several dims it works on its `dim=`, by default "tp".
    Each style places the parameters of the modules it matches over its dim and keeps the other dims as
    they are; every other parameter and buffer becomes a replicated MeshTensor (or stays the MeshTensor it
    already is). Build optimizers afterwards."""
    mesh, default, names = _mesh_and_dim(device_mesh, f"parallelize_module({type(module).__name__})")
    plan = {"": parallelize_plan} if isinstance(parallelize_plan, ParallelStyle) else parallelize_plan or {}
    if not isinstance(plan, Mapping):
        raise ShardingError(f"parallelize_module: parallelize_plan is {type(plan).__name__}; give a style or a dict "
                            "from module-name patterns to styles")
    memo: Memo = {}
    for name, sub, style in _matches(module, plan):
        dim = _dim_of(style, default, names, name)
        style.check(name, sub, dim, names)
        for pname, placement in style.param_placements(sub).items():
            _place(sub, pname, _qualname(name, pname), mesh, {dim: placement}, memo)
        style.install(sub, MeshDim(mesh, dim))
    _adopt(module, mesh, {}, memo)
    return module


def distribute_module(module: nn.Module, device_mesh: MeshLike | SubMesh | None = None,
                      partition_fn: PartitionFn | None = None, input_fn: HookFn | None = None,
                      output_fn: HookFn | None = None) -> nn.Module:
    """DTensor's distribute_module: `partition_fn(name, submodule, device_mesh)` runs for every submodule
    (it may replace parameters by MeshTensors placed as it likes); then every parameter and buffer still a
    plain tensor becomes replicated. `input_fn(module, inputs, device_mesh)` is installed as a forward
    pre-hook and `output_fn(module, outputs, device_mesh)` as a forward hook. Once per module."""
    what = f"distribute_module({type(module).__name__})"
    device_mesh = _given(device_mesh, what)
    if getattr(module, "_distribute_module_applied", False):
        raise ShardingError(f"{what}: distribute_module should only be called once on a module, but it has "
                            "already been called on this module; put all its placements in one partition_fn")
    for fn, kind in ((input_fn, "input_fn(module, inputs, device_mesh)"),
                     (output_fn, "output_fn(module, outputs, device_mesh)")):
        if fn is not None and len(inspect.signature(fn).parameters) != 3:
            raise ShardingError(f"{what}: {kind} takes 3 arguments, {fn!r} takes "
                                f"{len(inspect.signature(fn).parameters)}")
    if partition_fn is not None:
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, device_mesh)
    _adopt(module, _root(device_mesh), {}, {})
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    setattr(module, "_distribute_module_applied", True)  # nn.Module's __setattr__ is typed for tensors and modules
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


# -- the mesh and the dim ------------------------------------------------------------------------
def _mesh_and_dim(device_mesh: TpMesh | None, what: str) -> tuple[MeshLike, str | None, tuple[str, ...]]:
    """The mesh to place tensors on, the dim a style without `dim=` works on (None: "tp", as before
    DTensor's forms), and the dims a style may name."""
    if isinstance(device_mesh, tuple):
        mesh, dim = device_mesh
        names = tuple(mesh.extent.labels)
        check_dim(dim, names, what)
        return mesh, dim, names
    given = _given(device_mesh, what)
    names = tuple(given.extent.labels)
    if isinstance(given, SubMesh) and len(names) != 1:
        raise MeshError(f"{what}: tensor parallelism works over one mesh dim, and {given!r} has dims "
                        f"{list(names)}; pass one, e.g. mesh[{names[-1]!r}]")
    return _root(given), names[0] if len(names) == 1 else None, names


def _given(device_mesh: MeshLike | SubMesh | None, what: str) -> MeshLike | SubMesh:
    """`device_mesh`, or (None) the mesh of the innermost `with mesh:` block, as DTensor's current mesh."""
    mesh = default_mesh() if device_mesh is None else device_mesh
    if mesh is None:
        raise MeshError(f"{what}: no device_mesh given and no `with mesh:` block is open; pass the mesh")
    return cast("MeshLike | SubMesh", mesh)


def _root(device_mesh: MeshLike | SubMesh) -> MeshLike:
    """The mesh tensors are placed on: the mesh itself, or the one a view `mesh["tp"]` addresses."""
    return device_mesh.root if isinstance(device_mesh, SubMesh) else device_mesh


def _dim_of(style: ParallelStyle, default: str | None, names: tuple[str, ...], module_name: str) -> str:
    if style.dim is not None:
        return style.dim
    if default is None and "tp" not in names:
        raise MeshError(f"{style!r} on module {module_name!r}: the mesh has dims {list(names)} and no 'tp'; name the "
                        "style's dim (dim=...), or pass a mesh of one dim such as mesh['x'] or (mesh, 'x')")
    return default or "tp"


# -- placing tensors ----------------------------------------------------------------------------
def _matches(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, submodule, style) for every submodule a plan pattern matches; each pattern must match one."""
    modules = dict(module.named_modules())
    owner: dict[str, str] = {}
    found = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ShardingError(f"parallelize_module: plan[{pattern!r}] is {style!r}, not a style; use "
                                "ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...) "
                                "or PrepareModuleOutput(...)")
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
        setattr(module, "_monarch_loads", True)


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
