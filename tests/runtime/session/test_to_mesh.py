"""t.to_mesh(other, placements) between real meshes: values equal the source tensor for every pair of source
and target placements (uneven and empty pieces, Partial on either side), the destination runs no collective
(the source reduces its Partial dims, one all_reduce each), gradients go back to the source mesh, slices of
one proc mesh (pipeline stages) move as two meshes do, a compiled step spanning two meshes is recorded once and
follows plain torch, and the move is much faster than through the controller.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, tensor_shapes

import monarch
from monarch import Partial, Replicate, Shard
from monarch.actor import Actor, ProcMesh, endpoint, this_host
from monarch.errors import TraceError
from monarch.runtime.session.session import session_of

T = 60.0


@pytest.fixture(scope="module")
def meshes() -> Iterator[tuple[ProcMesh, ProcMesh]]:
    with this_host().spawn_procs(per_host={"dp": 2}) as a, this_host().spawn_procs(per_host={"x": 2, "y": 2}) as b:
        yield a, b


def collectives(mesh: ProcMesh) -> list[str]:
    return list(session_of(mesh).collectives)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_placement_pair_keeps_the_values(meshes: tuple[ProcMesh, ProcMesh], data: st.DataObject) -> None:
    a, b = meshes
    shape = data.draw(tensor_shapes(max_dims=3, max_size=7))
    src = data.draw(placement_tuples(len(shape), 1))
    dst = data.draw(placement_tuples(len(shape), 2))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool]))
    x = (torch.randn(shape) * 4).to(dtype)
    t = monarch.distribute_tensor(x, a, src)
    monarch.synchronize(a, T)
    before_a, before_b = len(collectives(a)), len(collectives(b))
    moved = t.to_mesh(b, dst)
    assert moved.placements == dst and moved.mesh is b
    assert collectives(b)[before_b:] == []  # the destination only reads
    assert collectives(a)[before_a:] == ["all_reduce[dp]"] * sum(isinstance(p, Partial) for p in src)
    got = moved.full_tensor(timeout=T)
    assert got.dtype == dtype
    if any(isinstance(p, Partial) for p in src) and dtype.is_floating_point:  # a sum of pieces: float rounding
        assert torch.allclose(got.double(), x.double(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, x)


def test_a_scalar_and_an_empty_tensor_move(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = meshes
    s = monarch.distribute_tensor(torch.tensor(3.5), a)
    assert s.to_mesh(b).full_tensor(timeout=T).item() == 3.5
    e = monarch.distribute_tensor(torch.empty(0, 3), a, {"dp": Shard(0)})
    assert e.to_mesh(b, {"x": Shard(0)}).full_tensor(timeout=T).shape == (0, 3)


def test_gradients_go_back_to_the_source_mesh(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = meshes
    x = torch.randn(6, 5)
    w = monarch.distribute_tensor(x, a, {"dp": Shard(0)}).requires_grad_(True)
    wt = x.clone().requires_grad_(True)
    y = (w * 2).to_mesh(b, {"x": Shard(1), "y": Shard(0)})
    (y.sin() * 3).sum().backward()
    (((wt * 2).sin()) * 3).sum().backward()
    assert w.grad is not None and w.grad.mesh is a and w.grad.placements == (Shard(0),)
    assert torch.allclose(w.grad.full_tensor(timeout=T), wt.grad, atol=1e-6)


def test_pipeline_stages_are_slices_of_one_mesh() -> None:
    with this_host().spawn_procs(per_host={"stage": 2, "dp": 2}) as procs:
        first, second = procs.slice(stage=0), procs.slice(stage=1)
        x = torch.randn(8, 4)
        h = monarch.distribute_tensor(x, first, {"dp": Shard(0)}) * 2
        out = h.to_mesh(second, {"dp": Shard(0)}) + 1
        assert torch.allclose(out.full_tensor(timeout=T), x * 2 + 1)


def test_a_compiled_step_across_two_meshes_is_recorded_once_and_equals_torch(
        meshes: tuple[ProcMesh, ProcMesh]) -> None:
    """Forward on one mesh, to_mesh, forward and loss on the other, backward through the move, both optimizers:
    one program per mesh, replayed; the values follow plain torch call after call."""
    a, b = meshes
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    plain = [copy.deepcopy(first), copy.deepcopy(second)]
    m0, m1 = monarch.parallelize_module(first, a, {}), monarch.parallelize_module(second, b, {})
    opts = [torch.optim.AdamW(m0.parameters(), lr=0.05), torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)]
    refs = [torch.optim.AdamW(plain[0].parameters(), lr=0.05),
            torch.optim.SGD(plain[1].parameters(), lr=0.1, momentum=0.9)]

    def step(model: list[torch.nn.Module], optims: list[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
             to: ProcMesh | None) -> torch.Tensor:
        h = torch.tanh(model[0](x))
        h = h.to_mesh(to, {"x": Shard(0)}) if to is not None else h
        loss = torch.nn.functional.mse_loss(model[1](h), y)
        loss.backward()
        for o in optims:
            o.step()
            o.zero_grad()
        return loss
    compiled = monarch.compile(lambda x, y: step([m0, m1], opts, x, y, b))
    for _ in range(4):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        got = compiled(monarch.distribute_tensor(x, a, {"dp": Shard(0)}),
                       monarch.distribute_tensor(y, b, {"x": Shard(0)}))
        want = step(plain, refs, x, y, None)
        assert got.mesh is b and abs(got.item() - want.item()) < 1e-5
    assert compiled.traces == 2  # the first call moves AdamW's step counts to the mesh; later ones replay
    for mine, theirs in zip([*m0.parameters(), *m1.parameters()], [*plain[0].parameters(), *plain[1].parameters()],
                            strict=True):
        assert torch.allclose(mine.full_tensor(timeout=T), theirs, atol=1e-5)


def test_inside_a_compiled_step_meshes_must_not_share_processes(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, _ = meshes
    t = monarch.distribute_tensor(torch.ones(4), a, {"dp": Shard(0)})

    @monarch.compile
    def step(u: torch.Tensor) -> torch.Tensor:
        return u.to_mesh(a.slice(dp=1)) * 2
    with pytest.raises(TraceError, match="no process in common"):
        step(t)


def test_a_plain_tensor_is_told_to_use_distribute_tensor(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, _ = meshes
    t = monarch.distribute_tensor(torch.ones(4), a, {"dp": Replicate()})
    assert t.to_mesh(a, {"dp": Shard(0)}).placements == (Shard(0),)  # the same mesh: a redistribution


def test_moving_64_mib_beats_the_controller_round_trip(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = meshes
    big = monarch.randn(2048, 8192, mesh=a, placements={"dp": Shard(0)})
    monarch.synchronize(a, T)
    big.to_mesh(b, {"x": Shard(0)})  # warm: the readers' first transfer maps the owners' tables
    start = time.perf_counter()
    moved = big.to_mesh(b, {"x": Shard(0)})
    direct = time.perf_counter() - start
    start = time.perf_counter()
    routed = monarch.distribute_tensor(big.full_tensor(timeout=T), b, {"x": Shard(0)})
    monarch.synchronize(b, T)
    through = time.perf_counter() - start
    assert torch.equal(moved[:4].full_tensor(timeout=T), routed[:4].full_tensor(timeout=T))
    assert direct < through, f"to_mesh {direct:.3f} s, through the controller {through:.3f} s"


def test_reference_meshes_move_in_process() -> None:
    a, b = monarch.LocalMesh({"dp": 2}), monarch.LocalMesh({"x": 2, "y": 2})
    x = torch.randn(5, 6)
    moved = monarch.distribute_tensor(x, a, {"dp": Shard(0)}).to_mesh(b, {"x": Shard(1), "y": Shard(0)})
    assert torch.equal(moved.full_tensor(), x)


class Stages(Actor):
    @endpoint
    def count(self) -> int:
        from monarch.runtime.engine.crossmesh import STAGES
        return len(STAGES)

    @endpoint
    def registered(self) -> int:
        """Regions this process has registered now (pieces exported, stages)."""
        from monarch.runtime.engine.transport.registry import registered
        r = registered()
        return r.live() if r is not None else 0


def test_eager_moves_leave_nothing_registered(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = meshes
    probe = a.spawn("regions", Stages)
    before = probe.registered.call().get(timeout=T).values()
    t = monarch.distribute_tensor(torch.randn(8, 8), a, {"dp": Shard(0)})
    for _ in range(5):
        t.to_mesh(b, {"x": Shard(1)})
    monarch.synchronize(a, T)  # the exports are freed with the source's next program
    assert probe.registered.call().get(timeout=T).values() == before


def test_a_retraced_step_unregisters_its_old_stages(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = meshes
    probe = a.spawn("stages", Stages)
    before = max(probe.count.call().get(timeout=T).values())
    layer = monarch.parallelize_module(torch.nn.Linear(4, 4), a, {})

    @monarch.compile
    def step(x: torch.Tensor) -> torch.Tensor:
        return layer(x).to_mesh(b, {"x": Shard(0)}).sum()
    x = monarch.distribute_tensor(torch.randn(4, 4), a, {"dp": Shard(0)})
    first = step(x).item()
    assert max(probe.count.call().get(timeout=T).values()) == before + 1
    layer.weight.data = layer.weight.detach().redistribute({"dp": Shard(0)})  # the program no longer fits
    assert step(x).item() == pytest.approx(first, rel=1e-5) and step.traces == 2
    assert max(probe.count.call().get(timeout=T).values()) == before + 1  # the first trace's stage is gone
