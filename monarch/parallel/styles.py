"""The tensor-parallel styles, with DTensor's names, keywords and defaults: ColwiseParallel,
RowwiseParallel, SequenceParallel, PrepareModuleInput and PrepareModuleOutput.

A style says how a module's own parameters are placed over one mesh dim (`param_placements`) and installs
forward hooks that bring its inputs and outputs to layouts over that dim (`install`). `dim=None` (the
default) is the dim of the mesh given to parallelize_module. Outputs are global MeshTensors: `use_local_output`
is accepted and checked, and changes nothing (a controller holds no rank's local piece).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn
from torch.utils._pytree import tree_map_only

from monarch.errors import ShardingError
from monarch.parallel.layouts import (Layouts, MeshDim, check_dim, check_flag, kwarg_layouts, layout_tuple, on_dim,
                                      one_layout, paired, paired_kwargs)
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Placement, Replicate, Shard


@dataclass(frozen=True, kw_only=True)
class ParallelStyle(abc.ABC):
    """Base of the styles: `dim` names the mesh dim the style works on (None: the mesh's own dim, see
    parallelize_module); `use_local_output` is DTensor's keyword, kept for the same code to run."""
    dim: str | None = None
    use_local_output: bool = True
    supports: ClassVar[tuple[type[nn.Module], ...]] = (nn.Module,)

    def __post_init__(self) -> None:
        if self.dim is not None and not isinstance(self.dim, str):
            raise ShardingError(f"{type(self).__name__}(dim={self.dim!r}): dim names a mesh dim, e.g. dim='tp'")
        check_flag(self.use_local_output, f"{type(self).__name__}(use_local_output)")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement over the style's dim of each of the module's own parameters this style decides."""
        return {}

    @abc.abstractmethod
    def install(self, module: nn.Module, on: MeshDim) -> None:
        """Forward hooks bringing the module's inputs and outputs to the style's layouts over `on.dim`."""

    def check(self, name: str, module: nn.Module, dim: str, names: tuple[str, ...]) -> None:
        """Errors naming the module when the dim is unknown or the module type is not supported."""
        check_dim(dim, names, f"{self!r} on module {name!r}")
        if not isinstance(module, self.supports):
            kinds = " and ".join(f"nn.{c.__name__}" for c in self.supports)
            raise ShardingError(
                f"{type(self).__name__}(dim={dim!r}) cannot shard module {name!r} "
                f"({type(module).__name__}): it supports {kinds}. Use SequenceParallel for norm or dropout "
                "layers, or leave the module out of the plan to replicate its parameters")


def _first_input(module: nn.Module, args: tuple, on: MeshDim, layout: Placement, desired: Placement) -> tuple:
    """The module's positional arguments with the first one brought from `layout` to `desired`."""
    if not args:
        raise ShardingError(f"{type(module).__name__} was called without a positional input; its style "
                            "prepares the first positional argument")
    return (on.prepare(args[0], layout, desired, f"the input of {type(module).__name__}"), *args[1:])


def _outputs_to(out: Any, on: MeshDim, layout: Placement) -> Any:
    return tree_map_only(MeshTensor, lambda t: on_dim(t, on.dim, layout), out)


@dataclass(frozen=True, kw_only=True)
class _LinearStyle(ParallelStyle):
    """Colwise and Rowwise: nn.Linear and nn.Embedding, one input layout and one output layout."""
    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    supports: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear, nn.Embedding)
    defaults: ClassVar[tuple[Placement, Placement]]  # input and output layouts when not given

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        ins = one_layout(self.input_layouts, f"{name}(input_layouts)") or self.defaults[0]
        outs = one_layout(self.output_layouts, f"{name}(output_layouts)") or self.defaults[1]
        object.__setattr__(self, "input_layouts", ins)
        object.__setattr__(self, "output_layouts", outs)

    def desired_input(self, module: nn.Module) -> Placement:
        return Replicate()

    def install(self, module: nn.Module, on: MeshDim) -> None:
        assert self.input_layouts is not None and self.output_layouts is not None
        ins, want, outs = self.input_layouts, self.desired_input(module), self.output_layouts
        module.register_forward_pre_hook(lambda mod, args: _first_input(mod, args, on, ins, want))
        module.register_forward_hook(lambda mod, args, out: _outputs_to(out, on, outs))


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(_LinearStyle):
    """nn.Linear: weight (out, in) and bias sharded on the output features; nn.Embedding: weight sharded on
    the embedding dim. The input (said to be `input_layouts`, default Replicate()) is made Replicate; the
    output (sharded on its last dim) is made `output_layouts` (default Shard(-1))."""
    defaults: ClassVar[tuple[Placement, Placement]] = (Replicate(), Shard(-1))

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        return {"weight": Shard(0), **({"bias": Shard(0)} if module.bias is not None else {})}


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(_LinearStyle):
    """nn.Linear: weight sharded on the input features, bias replicated, the input (said to be
    `input_layouts`, default Shard(-1)) made Shard(-1); nn.Embedding: weight sharded on the vocabulary, the
    indices made Replicate. The output (a Partial sum) is made `output_layouts`: Replicate() by default (one
    all_reduce), Shard(1) for sequence parallelism (a reduce_scatter), Partial() to keep it a partial sum."""
    defaults: ClassVar[tuple[Placement, Placement]] = (Shard(-1), Replicate())

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        return {"weight": Shard(1), **({"bias": Replicate()} if module.bias is not None else {})}

    def desired_input(self, module: nn.Module) -> Placement:
        return Replicate() if isinstance(module, nn.Embedding) else Shard(-1)


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """Any module (layer norm, dropout): its own parameters replicated, its first input sharded on
    `sequence_dim` (a plain tensor is placed so, a MeshTensor redistributed), so its output stays so."""
    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sequence_dim, int) or isinstance(self.sequence_dim, bool):
            raise ShardingError(f"SequenceParallel(sequence_dim={self.sequence_dim!r}): give a tensor dim (int)")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Replicate() for name, _ in module.named_parameters(recurse=False)}

    def install(self, module: nn.Module, on: MeshDim) -> None:
        seq = Shard(self.sequence_dim)
        module.register_forward_pre_hook(lambda mod, args: _first_input(mod, args, on, seq, seq))


@dataclass(frozen=True, kw_only=True)
class PrepareModuleInput(ParallelStyle):
    """Positional inputs said to be `input_layouts` (one placement, or a tuple with None for arguments left
    alone) brought to `desired_input_layouts`; keyword inputs likewise by name. Lengths and keys must agree;
    a layout given for an argument that is not a tensor raises when the module is called."""
    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_output: bool = False
    _names: ClassVar[tuple[tuple[str, str], tuple[str, str]]] = (
        ("input_layouts", "desired_input_layouts"), ("input_kwarg_layouts", "desired_input_kwarg_layouts"))

    def __post_init__(self) -> None:
        super().__post_init__()
        args = [layout_tuple(getattr(self, f), f"PrepareModuleInput({f})") for f in self._names[0]]
        kwargs = [kwarg_layouts(getattr(self, f), f"PrepareModuleInput({f})") for f in self._names[1]]
        for f, v in [*zip(self._names[0], args, strict=True), *zip(self._names[1], kwargs, strict=True)]:
            object.__setattr__(self, f, v)
        paired(args[0], args[1], self._names[0], optional_desired=True)
        paired_kwargs(kwargs[0], kwargs[1], self._names[1])

    def install(self, module: nn.Module, on: MeshDim) -> None:
        module.register_forward_pre_hook(lambda mod, args, kwargs: self._prepare(mod, args, kwargs, on),
                                         with_kwargs=True)

    def _prepare(self, module: nn.Module, args: tuple, kwargs: dict, on: MeshDim) -> tuple[tuple, dict]:
        what = type(module).__name__
        layouts, desired = self.input_layouts, self.desired_input_layouts
        if layouts is not None:
            assert isinstance(layouts, tuple) and isinstance(desired, tuple), (layouts, desired)
            if len(args) != len(layouts):
                raise ShardingError(f"module inputs and input_layouts should have same length! {what} got "
                                    f"{len(args)} positional inputs, input_layouts={layouts}")
            args = tuple(on.prepare(a, lay, d, f"positional input {i} of {what}")
                         for i, (a, lay, d) in enumerate(zip(args, layouts, desired, strict=True)))
        kw, want = self.input_kwarg_layouts or {}, self.desired_input_kwarg_layouts or {}
        kwargs = {k: on.prepare(v, kw.get(k), want.get(k), f"keyword input {k!r} of {what}") for k, v in kwargs.items()}
        return args, kwargs


@dataclass(frozen=True, kw_only=True)
class PrepareModuleOutput(ParallelStyle):
    """Outputs said to be `output_layouts` (one placement, or a tuple with None for outputs left alone)
    brought to `desired_output_layouts`. A single output comes back alone, several as a tuple (as in DTensor)."""
    output_layouts: Layouts
    desired_output_layouts: Layouts
    _names: ClassVar[tuple[str, str]] = ("output_layouts", "desired_output_layouts")

    def __post_init__(self) -> None:
        super().__post_init__()
        outs = [layout_tuple(getattr(self, f), f"PrepareModuleOutput({f})") for f in self._names]
        for f, v in zip(self._names, outs, strict=True):
            object.__setattr__(self, f, v)
        if outs[0] is None:
            raise ShardingError("PrepareModuleOutput needs output_layouts and desired_output_layouts")
        paired(outs[0], outs[1], self._names, optional_desired=False)

    def install(self, module: nn.Module, on: MeshDim) -> None:
        module.register_forward_hook(lambda mod, args, out: self._prepare(mod, out, on))

    def _prepare(self, module: nn.Module, out: Any, on: MeshDim) -> Any:
        layouts, desired = self.output_layouts, self.desired_output_layouts
        assert isinstance(layouts, tuple) and isinstance(desired, tuple), (layouts, desired)
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != len(layouts):
            raise ShardingError(f"module outputs and output_layouts should have same length! "
                                f"{type(module).__name__} returned {len(outs)} outputs, output_layouts={layouts}")
        done = tuple(on.prepare(o, lay, d, f"output {i} of {type(module).__name__}")
                     for i, (o, lay, d) in enumerate(zip(outs, layouts, desired, strict=True)))
        return done[0] if len(done) == 1 else done
