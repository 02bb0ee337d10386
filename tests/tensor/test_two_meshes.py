"""Tensors of two real meshes (a 2-process and a 1-process one): factories and distribute_tensor make
tensors of the mesh they name whatever mesh is active, and an op mixing the two meshes fails on the
controller before anything is recorded or shipped, naming the op, both meshes and the fix.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import monarch
from monarch import MeshTensor, Shard
from monarch.actor import ProcMesh, this_host
from monarch.runtime.session.session import session_of

T = 30.0  # seconds any single wait may take


@pytest.fixture(scope="module")
def two() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"dp": 2}, name="two") as p:
        yield p


@pytest.fixture(scope="module")
def one() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"x": 1}, name="one") as p:
        yield p


def fetch(t: MeshTensor) -> torch.Tensor:
    return t.full_tensor(timeout=T)


def test_factories_naming_a_mesh_make_its_tensors_inside_another_activate(two: ProcMesh, one: ProcMesh) -> None:
    t = torch.arange(6.0).reshape(3, 2)
    with two.activate():
        made = {
            "distribute_tensor": monarch.distribute_tensor(t, one, {"x": Shard(0)}),
            "distribute_tensor of an activated factory": monarch.distribute_tensor(torch.ones(3, 2), one),
            "randn": monarch.randn(3, 2, mesh=one), "zeros": monarch.zeros(3, 2, mesh=one),
            "full": monarch.full(3, 2, fill_value=2.0, mesh=one), "arange": monarch.arange(6, mesh=one),
            "randint": monarch.randint(0, 5, (3, 2), mesh=one),
        }
        here = torch.ones(3, 2)
    assert here.mesh is two
    for what, x in made.items():
        assert x.mesh is one and x._backend is session_of(one), what
        assert type(x._handle).__name__ == "Value", f"{what}: the tensor wraps another MeshTensor"
    assert torch.equal(fetch(made["distribute_tensor"]), t)
    assert made["distribute_tensor"].placements == (Shard(0),)
    assert torch.equal(fetch(made["distribute_tensor of an activated factory"]), torch.ones(3, 2))
    assert torch.equal(fetch(made["arange"]), torch.arange(6))


MIXED: dict[str, Callable[[Any, Any], Any]] = {
    "add.Tensor": lambda a, o: a + o,
    "mul.Tensor": lambda a, o: o * a,
    "cat.default": lambda a, o: torch.cat([a, o]),
    "equal.default": torch.equal,
    "add_.Tensor": lambda a, o: a.add_(o),
    "mm.default": torch.mm,
    "addcmul.default": lambda a, o: torch.addcmul(a, a, o),
}


@pytest.mark.parametrize("op", sorted(MIXED))
def test_an_op_mixing_two_meshes_fails_before_anything_ships(two: ProcMesh, one: ProcMesh, op: str) -> None:
    with two.activate():
        a = torch.ones(2, 2)
        o = monarch.distribute_tensor(torch.full((2, 2), 3.0), one)
    monarch.synchronize(two, T), monarch.synchronize(one, T)
    sessions = (session_of(two), session_of(one))
    before = [(s.flushes, s.tracer.n_ops, s.mesh._mesh.frames) for s in sessions]
    with pytest.raises(monarch.ShardingError) as e:
        MIXED[op](a, o)
    msg = str(e.value)
    assert op in msg and "'two'" in msg and "'one'" in msg and "full_tensor()" in msg and "distribute_tensor" in msg
    assert [(s.flushes, s.tracer.n_ops, s.mesh._mesh.frames) for s in sessions] == before  # nothing recorded or sent
    assert torch.equal(fetch(a + a), torch.full((2, 2), 2.0))  # both meshes still work, `a` unchanged
    assert torch.equal(fetch(o * o), torch.full((2, 2), 9.0))
    moved = monarch.distribute_tensor(o.full_tensor(timeout=T), two)  # the explicit move the message names
    assert torch.equal(fetch(a + moved), torch.full((2, 2), 4.0))


def test_distribute_tensor_across_meshes_sends_the_gradient_back(two: ProcMesh, one: ProcMesh) -> None:
    """A tensor computed on one mesh, distributed to another: its gradient returns to the first mesh,
    placed as the tensor was there, equal to plain torch's."""
    data = torch.randn(4, 3)
    src = monarch.distribute_tensor(data, two, {"dp": Shard(0)}).requires_grad_()
    moved = monarch.distribute_tensor(src.exp(), one)
    (moved * moved).sum().backward()
    plain = data.clone().requires_grad_()
    (plain.exp() * plain.exp()).sum().backward()
    assert src.grad.mesh is two and src.grad.placements == (Shard(0),)
    torch.testing.assert_close(fetch(src.grad), plain.grad)
