"""Random tensor programs on MeshTensors equal the same programs in plain torch.

Programs come from `strategies.programs` (pointwise ops with broadcasting and scalars, comparisons and
where, casts, matmuls, reductions, softmax, layout changes, views, cat, redistribute) over random
shapes and placements. Property A runs them on the in-process reference mesh; property B on real
worker processes, where values must also match the reference and the collectives must be the same.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import Program, programs, reference_mesh, run_program, tensor_meshes

import monarch
from monarch import Shard
from monarch.actor import ProcMesh, this_host
from monarch.runtime.session import api
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import session_of

pytestmark = pytest.mark.filterwarnings("ignore:monarch. .* has no sharding rule")

TIMEOUT = 30.0


def plain(program: Program) -> list[torch.Tensor]:
    values = run_program(program, lambda data, placements: data, lambda x, placements: x)
    return [values[i] for i in program.outputs()]


def on_mesh(program: Program, mesh: Any) -> tuple[list[torch.Tensor], list[str]]:
    """The program's outputs run on `mesh`, and the collectives it shipped (fetches included)."""
    session = session_of(mesh)
    session.synchronize(TIMEOUT)
    before = len(session.collectives)
    values = run_program(program, lambda data, placements: monarch.distribute_tensor(data, mesh, placements),
                         lambda x, placements: x.redistribute(placements))
    outs = [values[i].full_tensor(timeout=TIMEOUT) for i in program.outputs()]
    return outs, session.collectives[before:]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], program: Program) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is torch.Tensor, f"{program}: fetched a {type(g).__name__}"
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{program}: {g.dtype}{list(g.shape)}, want {w.dtype}{w.shape}"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, equal_nan=True, msg=lambda m: f"{program}\n{m}")


@st.composite
def mesh_programs(draw: st.DrawFn, meshes: tuple[dict[str, int], ...]) -> tuple[dict[str, int], Program]:
    dims = draw(tensor_meshes(meshes))
    return dims, draw(programs(len(dims)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh_programs(({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})))
def test_programs_on_reference_equal_torch(case: tuple[dict[str, int], Program]) -> None:
    dims, program = case
    got, _ = on_mesh(program, reference_mesh(dims))
    assert_same(got, plain(program), program)


# -- real processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[{"x": 4}, {"dp": 2, "tp": 2}], ids=["x4", "dp2xtp2"])
def real_mesh(request: pytest.FixtureRequest) -> Iterator[ProcMesh]:
    """One real mesh at a time (4 workers): a flat one spawned here, then the shared dp=2 x tp=2 one."""
    if "dp" in request.param:
        yield request.getfixturevalue("procs")
        return
    with this_host().spawn_procs(per_host=request.param) as procs:
        yield procs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_programs_on_processes_equal_torch_and_reference(real_mesh: ProcMesh, data: st.DataObject) -> None:
    dims = dict(real_mesh.extent)
    program = data.draw(programs(len(dims), max_ops=5), label="program")
    want = plain(program)
    got, comms = on_mesh(program, real_mesh)
    ref, ref_comms = on_mesh(program, reference_mesh(dims))
    assert_same(got, want, program)
    assert_same(got, ref, program)
    assert comms == ref_comms, program


def test_factories_under_activate_on_the_reference_mesh_equal_processes(real_mesh: ProcMesh) -> None:
    """activate() on the in-process mesh: its engines run plain torch (the factory mode does not reach the
    kernels' own torch.rand), so draws and initialisers give the values a real mesh gives."""
    def build(mesh: object) -> list[torch.Tensor]:
        monarch.manual_seed(7)
        with api.activate(mesh):
            x, w = torch.randn(5, 3), torch.empty(4, 6)
            torch.nn.init.kaiming_uniform_(w)
            return [x.full_tensor(), w.full_tensor(), torch.arange(6).full_tensor()]
    local, real = build(LocalMesh(dict(real_mesh.extent))), build(real_mesh)
    for a, b in zip(local, real, strict=True):
        assert torch.equal(a, b)
    assert local[0].std() > 0.5 and local[1].abs().sum() > 0


def test_views_of_one_mesh_keep_their_buffers_apart(procs: ProcMesh) -> None:
    """Tensors of several views of one proc mesh (the mesh, a flattened view, one process) live in the
    same worker stores: each keeps its own values, also after another view's tensors are freed."""
    T = 60.0
    a = monarch.distribute_tensor(torch.arange(4.0), procs, {"dp": Shard(0)})
    flat = procs.flatten("dp")
    b = monarch.distribute_tensor(torch.arange(8.0) * 10, flat, {"dp": Shard(0)})
    c = monarch.distribute_tensor(torch.full((3,), 7.0), procs.slice(dp=0, tp=0))
    assert torch.equal(a.full_tensor(timeout=T), torch.arange(4.0))
    assert torch.equal(b.full_tensor(timeout=T), torch.arange(8.0) * 10)
    del b
    d = monarch.distribute_tensor(torch.ones(8), flat, {"dp": Shard(0)})
    assert torch.equal((d * 2).full_tensor(timeout=T), torch.full((8,), 2.0))
    assert torch.equal(a.full_tensor(timeout=T), torch.arange(4.0))
    assert torch.equal(c.full_tensor(timeout=T), torch.full((3,), 7.0))
