"""DTensor's tensor-parallel API (monarch.dtensor.parallel) on LocalMesh: the styles' placements, values,
gradients and collectives against plain torch, PrepareModuleInput/Output per argument and keyword, the
validation errors, and distribute_module with custom functions.

A tensor-parallel MLP (ColwiseParallel then RowwiseParallel) written with DTensor's names runs on a 1-D
mesh, on `mesh["tp"]` of a dp x tp mesh and on monarch's `(mesh, "tp")`: one all_reduce over tp forward.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from monarch.dtensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from monarch.dtensor.debug import CommDebugMode
from monarch.dtensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel,
                                      SequenceParallel, parallelize_module)
from monarch.errors import MeshError, ShardingError
from monarch.runtime.session.local import LocalMesh
from tests.end_to_end.test_parallel import MLP

PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def collectives(fn: Callable[[], Any]) -> tuple[list[str], Any]:
    """What `fn` ships ("all_reduce[tp]", ...), and what it returned."""
    with CommDebugMode() as comm:
        out = fn()
    return comm.collectives, out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.full_tensor() if isinstance(got, DTensor) else got, want, atol=2e-5, rtol=1e-4)


def check_mlp(tp_mesh: Any, lead: tuple) -> None:
    """The TP MLP on `tp_mesh` against plain torch: placements, output, parameter gradients, one SGD step,
    and the collectives (one all_reduce over tp forward, none backward for an input that needs no grad).
    `lead` is the placements of the mesh dims before tp."""
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), tp_mesh, PLAN)
    assert model.fc1.weight.placements == (*lead, Shard(0)) and model.fc2.weight.placements == (*lead, Shard(1))
    assert model.fc2.bias.placements == (*lead, Replicate())
    x = torch.randn(6, 8)
    comms, out = collectives(lambda: model(x))
    assert comms == ["all_reduce[tp]"] and out.placements == (*lead, Replicate())
    close(out, ref(x))
    comms, _ = collectives(lambda: out.pow(2).sum().backward())
    assert comms == []
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad.placements == p.placements, name
        close(p.grad, q.grad)
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    close(model(x), ref(x))


def test_mlp_on_a_1d_mesh_matches_torch() -> None:
    mesh = LocalMesh({"tp": 2})
    check_mlp(mesh, ())


@pytest.mark.parametrize("form", ["view", "tuple"])
def test_mlp_on_tp_of_dp_x_tp_matches_torch(form: str) -> None:
    mesh = LocalMesh({"dp": 2, "tp": 2})
    check_mlp(mesh["tp"] if form == "view" else (mesh, "tp"), (Replicate(),))


def test_a_bare_style_applies_to_the_module_and_the_default_mesh_is_used() -> None:
    """parallelize_module(linear, mesh, ColwiseParallel(...)): the module itself; no device_mesh inside
    `with mesh:`; output_layouts=Replicate() all-gathers the sharded output."""
    lin = nn.Linear(4, 6)
    want = lin(x := torch.randn(3, 4))
    mesh = LocalMesh({"tp": 2})
    with mesh:
        parallelize_module(lin, parallelize_plan=ColwiseParallel(output_layouts=Replicate()))
    assert lin.weight.placements == (Shard(0),)
    comms, out = collectives(lambda: lin(x))
    assert comms == ["all_gather[tp]"] and out.placements == (Replicate(),)
    close(out, want)


@pytest.mark.parametrize("layouts, comms, placed", [
    ({}, ["all_reduce[tp]"], Replicate()),
    ({"output_layouts": Shard(0)}, ["reduce_scatter[tp]"], Shard(0)),
    ({"output_layouts": Partial()}, [], Partial()),
    ({"input_layouts": Replicate()}, ["all_reduce[tp]"], Replicate()),  # a plain input is placed Shard(-1) directly
])
def test_rowwise_input_and_output_layouts(layouts: dict, comms: list[str], placed: Any) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    mesh = LocalMesh({"tp": 2})
    lin = parallelize_module(copy.deepcopy(ref), mesh, RowwiseParallel(**layouts))
    x = torch.randn(6, 8)
    got, out = collectives(lambda: lin(x))
    assert got == comms and out.placements == (placed,)
    close(out, ref(x))


def test_embedding_rowwise_with_sequence_parallel_norm() -> None:
    """The torchtitan pattern: a Rowwise embedding into sequence-sharded output (reduce_scatter), a
    SequenceParallel LayerNorm on it (no collective), then a Colwise head taking Shard(1) input."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16))
    mesh = LocalMesh({"tp": 2})
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "1": SequenceParallel(),
        "2": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    idx = torch.randint(0, 16, (2, 6))
    comms, out = collectives(lambda: model(idx))
    assert comms == ["reduce_scatter[tp]", "all_gather[tp]", "all_gather[tp]"], comms
    assert model[0].weight.placements == (Shard(0),) and model[1].weight.placements == (Replicate(),)
    close(out, ref(idx))
    norm = parallelize_module(copy.deepcopy(ref[1]), mesh, SequenceParallel(sequence_dim=0))
    comms, y = collectives(lambda: norm(distribute_tensor(torch.ones(4, 3, 8), mesh, [Shard(1)])))
    assert y.placements == (Shard(0),) and comms == ["all_to_all[tp]"], comms


class Mix(nn.Module):
    """Records the placements its tensor inputs arrive with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, y: Any, *, z: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        self.seen = {k: getattr(v, "placements", type(v).__name__) for k, v in (("x", x), ("y", y), ("z", z))}
        return x * scale + z


def test_prepare_module_input_per_argument_and_keyword() -> None:
    mesh = LocalMesh({"tp": 2})
    mix = parallelize_module(Mix(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"z": Shard(0)}, desired_input_kwarg_layouts={"z": Replicate()}))
    x, z = torch.randn(4, 3), torch.randn(4, 3)
    comms, out = collectives(lambda: mix(distribute_tensor(x, mesh, [Shard(0)]), "tag", z=z, scale=3.0))
    assert comms == ["all_gather[tp]"], "the sharded x is gathered; the plain z is placed as asked, no collective"
    assert mix.seen == {"x": (Replicate(),), "y": "str", "z": (Replicate(),)}
    close(out, x * 3.0 + z)
    only_kw = parallelize_module(Mix(), mesh, PrepareModuleInput(input_kwarg_layouts={"z": Shard(0)},
                                                                 desired_input_kwarg_layouts={"z": Shard(1)}))
    only_kw(torch.ones(4, 4), None, z=torch.ones(4, 4))
    assert only_kw.seen == {"x": "Tensor", "y": "NoneType", "z": (Shard(1),)}


class Pair(nn.Module):
    def forward(self, a: torch.Tensor, b: Any) -> tuple[torch.Tensor, Any]:
        return a, b


def test_prepare_module_output_per_output() -> None:
    mesh = LocalMesh({"tp": 2})
    pair = parallelize_module(Pair(), mesh, PrepareModuleOutput(output_layouts=(Shard(0), None),
                                                                desired_output_layouts=(Replicate(), None)))
    a = torch.randn(4, 2)
    comms, (got, b) = collectives(lambda: pair(distribute_tensor(a, mesh, [Shard(0)]), 7))
    assert comms == ["all_gather[tp]"] and got.placements == (Replicate(),) and b == 7
    close(got, a)
    one = parallelize_module(nn.Identity(), mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                      desired_output_layouts=Shard(1)))
    out = one(a)  # a plain output said to be Replicate: placed as Shard(1) directly
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    close(out, a)


def test_use_local_output_keeps_global_mesh_tensors() -> None:
    mesh = LocalMesh({"tp": 2})
    for local in (True, False):
        lin = parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel(use_local_output=local))
        out = lin(torch.randn(2, 4))
        assert isinstance(out, DTensor) and out.placements == (Shard(1),) and out.shape == (2, 4)


def test_style_validation_errors() -> None:
    with pytest.raises(ShardingError, match=r"input_layouts and desired_input_layouts should have same length"):
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=(Replicate(), None))
    with pytest.raises(ShardingError, match=r"desired_input_layouts is None while input_layouts is given"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(ShardingError, match=r"desired_input_layouts\[1\] is R but input_layouts\[1\] is None"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), Replicate()))
    with pytest.raises(ShardingError, match=r"input_kwarg_layouts and desired_input_kwarg_layouts should have same"):
        PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"z": Replicate()})
    with pytest.raises(ShardingError, match=r"output_layouts and desired_output_layouts should have same length"):
        PrepareModuleOutput(output_layouts=(Replicate(), Replicate()), desired_output_layouts=Shard(0))
    with pytest.raises(ShardingError, match=r"desired_output_layouts\[0\] is None"):
        PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(None,))
    with pytest.raises(ShardingError, match=r"ColwiseParallel\(output_layouts\)=\{'tp': R\} is not a placement.*dict"):
        ColwiseParallel(output_layouts={"tp": Replicate()})
    with pytest.raises(ShardingError, match=r"PrepareModuleInput\(input_layouts\)=\{'tp': S\(0\)\} is neither"):
        PrepareModuleInput(input_layouts={"tp": Shard(0)}, desired_input_layouts={"tp": Replicate()})
    with pytest.raises(ShardingError, match=r"desired_input_kwarg_layouts\)\['z'\]='R' is not a placement"):
        PrepareModuleInput(input_kwarg_layouts={"z": Shard(0)}, desired_input_kwarg_layouts={"z": "R"})
    with pytest.raises(ShardingError, match=r"use_local_output\)='yes' is not a bool"):
        RowwiseParallel(use_local_output="yes")
    with pytest.raises(TypeError):
        ColwiseParallel(Replicate())  # keyword-only, as in DTensor


def test_call_time_errors() -> None:
    mesh = LocalMesh({"tp": 2})
    mix = parallelize_module(Mix(), mesh, PrepareModuleInput(input_layouts=(Shard(0), Shard(0)),
                                                             desired_input_layouts=(Replicate(), Replicate())))
    with pytest.raises(ShardingError, match=r"positional input 1 of Mix is str, not a tensor, but has the layout"):
        mix(torch.ones(2, 2), "tag", z=torch.ones(2, 2))
    short = parallelize_module(Mix(), mesh, PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Shard(0)))
    with pytest.raises(ShardingError, match=r"module inputs and input_layouts should have same length! Mix got 2"):
        short(torch.ones(2, 2), None, z=torch.ones(2, 2))
    pair = parallelize_module(Pair(), mesh, PrepareModuleOutput(output_layouts=Shard(0),
                                                                desired_output_layouts=Shard(0)))
    with pytest.raises(ShardingError, match=r"module outputs and output_layouts should have same length! Pair "
                                            r"returned 2"):
        pair(torch.ones(2, 2), torch.ones(2, 2))


def test_mesh_errors() -> None:
    mesh = LocalMesh({"dp": 2, "tp": 2})
    with pytest.raises(MeshError, match=r"one mesh dim.*has dims \['dp', 'tp'\]; pass one, e.g. mesh\['tp'\]"):
        parallelize_module(MLP(), LocalMesh({"pp": 1, "dp": 2, "tp": 2})["dp", "tp"], PLAN)
    with pytest.raises(MeshError, match=r"on module 'fc1': the mesh has no dim 'dp' \(its dims are \['tp'\]\)"):
        parallelize_module(MLP(), mesh["tp"], {"fc1": ColwiseParallel(dim="dp")})
    with pytest.raises(MeshError, match=r"the mesh has dims \['dp', 'x'\] and no 'tp'.*mesh\['x'\]"):
        parallelize_module(MLP(), LocalMesh({"dp": 2, "x": 2}), PLAN)
    with pytest.raises(MeshError, match=r"no device_mesh given and no `with mesh:` block is open"):
        parallelize_module(MLP(), None, PLAN)
    with pytest.raises(MeshError, match=r"parallelize_module\(MLP\): the mesh has no dim 'model'"):
        parallelize_module(MLP(), (mesh, "model"), PLAN)


def test_distribute_module_with_custom_functions() -> None:
    """partition_fn runs for every submodule with the mesh, untouched tensors are replicated; input_fn and
    output_fn run as forward hooks with the mesh."""
    mesh = LocalMesh({"dp": 2, "tp": 2})
    tp = mesh["tp"]
    torch.manual_seed(0)
    ref = MLP()
    names: list[str] = []

    def partition(name: str, module: nn.Module, device_mesh: Any) -> None:
        names.append(name)
        assert device_mesh is tp
        if name == "fc1":
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))

    def shard_batch(module: nn.Module, inputs: tuple, device_mesh: Any) -> tuple:
        return tuple(distribute_tensor(t, device_mesh, [Shard(0)]) for t in inputs)

    def gather(module: nn.Module, outputs: torch.Tensor, device_mesh: Any) -> torch.Tensor:
        return outputs.redistribute(placements=[Replicate(), Replicate()])

    model = distribute_module(copy.deepcopy(ref), tp, partition, shard_batch, gather)
    assert names == ["", "fc1", "fc2"]
    assert model.fc1.weight.placements == (Replicate(), Shard(0)) and model.fc1.bias.placements == (Replicate(),) * 2
    assert model.fc2.weight.placements == (Replicate(), Replicate()) and model.fc1.weight.requires_grad
    x = torch.randn(6, 8)
    out = model(x)
    assert out.placements == (Replicate(), Replicate())
    close(out, ref(x))
    with pytest.raises(ShardingError, match=r"distribute_module should only be called once on a module"):
        distribute_module(model, tp)
    with pytest.raises(ShardingError, match=r"input_fn\(module, inputs, device_mesh\) takes 3 arguments"):
        distribute_module(MLP(), tp, input_fn=lambda inputs, device_mesh: inputs)
    plain = distribute_module(MLP(), tp)
    assert all(p.placements == (Replicate(), Replicate()) for p in plain.parameters())
