"""The MeshTensor API on real worker processes (the module's dp=2 x tp=2 mesh).

Factories and their placements, seeded random values, `activate()`, round trips of uneven shapes, sync
points (item, tolist, repr, fetch), rank tensors, tensor-parallel linears and their collectives,
in-place ops, local_map, errors raised on the controller before shipping and errors raised on workers,
and that temporaries are freed on the workers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_tuples, tensor_shapes

import monarch
from monarch import MeshTensor, Partial, Replicate, Shard
from monarch.actor import Actor, ProcMesh, endpoint
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import Session, session_of

pytestmark = pytest.mark.filterwarnings("ignore:monarch. .* has no sharding rule")

T = 30.0  # seconds any single wait may take
R, P = Replicate(), Partial("sum")


def fetch(t: MeshTensor) -> torch.Tensor:
    return t.full_tensor(timeout=T)


def synced(procs: ProcMesh) -> Session:
    """The mesh's session with nothing pending."""
    s = session_of(procs)
    s.synchronize(T)
    return s


# -- factories --------------------------------------------------------------------------------------

PLACEMENTS = [{"tp": Shard(1)}, {"dp": Shard(0)}, [Shard(0), Shard(1)], [Shard(1), Shard(1)], None, {}]
EXPECTED = [(R, Shard(1)), (Shard(0), R), (Shard(0), Shard(1)), (Shard(1), Shard(1)), (R, R), (R, R)]


@pytest.mark.parametrize("placements, expected", list(zip(PLACEMENTS, EXPECTED, strict=True)))
def test_constant_factories(procs: ProcMesh, placements: Any, expected: tuple) -> None:
    cases: list[tuple[MeshTensor, torch.Tensor]] = [
        (monarch.zeros(5, 3, mesh=procs, placements=placements), torch.zeros(5, 3)),
        (monarch.ones((5, 3), mesh=procs, placements=placements), torch.ones(5, 3)),
        (monarch.full(5, 3, fill_value=3.5, mesh=procs, placements=placements), torch.full((5, 3), 3.5)),
        (monarch.full(5, 3, fill_value=7, mesh=procs, placements=placements), torch.full((5, 3), 7)),
        (monarch.empty(5, 3, mesh=procs, placements=placements, dtype=torch.float64),
         torch.zeros(5, 3, dtype=torch.float64)),
    ]
    for t, want in cases:
        assert isinstance(t, MeshTensor) and t.placements == expected and t.mesh is procs
        got = fetch(t)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("placements", [{"dp": Shard(0)}, [Shard(0), Shard(0)], None])
def test_arange(procs: ProcMesh, placements: Any) -> None:
    assert torch.equal(fetch(monarch.arange(7, mesh=procs, placements=placements)), torch.arange(7))
    got = fetch(monarch.arange(1.0, 3.5, 0.25, mesh=procs, placements=placements))
    torch.testing.assert_close(got, torch.arange(1.0, 3.5, 0.25))


def randint(*shape: int, **kwargs: Any) -> MeshTensor:
    return monarch.randint(-50, 50, shape, **kwargs)


@pytest.mark.parametrize("make", [monarch.randn, monarch.rand, randint])
def test_random_values_depend_on_seed_not_placement(procs: ProcMesh, make: Callable[..., MeshTensor]) -> None:
    draws = []
    for placements in [None, {"tp": Shard(1)}, [Shard(0), Shard(0)], [Shard(1), Shard(0)]]:
        monarch.manual_seed(1234)
        draws.append(fetch(make(7, 5, mesh=procs, placements=placements)))
    for d in draws[1:]:
        assert torch.equal(d, draws[0])
    monarch.manual_seed(1234)
    first, second = fetch(make(7, 5, mesh=procs)), fetch(make(7, 5, mesh=procs))
    assert torch.equal(first, draws[0]) and not torch.equal(first, second)
    if make is monarch.rand:
        assert 0 <= first.min() and first.max() < 1
    if make is randint:
        assert first.dtype == torch.int64 and -50 <= first.min() and first.max() < 50


def test_activate_makes_replicated_mesh_tensors(procs: ProcMesh) -> None:
    with procs.activate():
        x = torch.randn(4, 4)
        z = torch.zeros(2, 3)
    assert isinstance(x, MeshTensor) and x.placements == (R, R) and x.shape == (4, 4)
    assert torch.equal(fetch(z), torch.zeros(2, 3))
    assert fetch(x).shape == (4, 4)
    assert type(torch.randn(2)) is torch.Tensor  # outside the block: plain torch again


# -- data round trips and sync points ---------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(st.data())
def test_distribute_full_tensor_round_trip(procs: ProcMesh, data: st.DataObject) -> None:
    shape = data.draw(tensor_shapes(min_dims=1, max_dims=3, max_size=7))
    placements = data.draw(placement_tuples(len(shape), 2))
    t = torch.randn(shape)
    x = monarch.distribute_tensor(t, procs, placements)
    assert x.placements == placements and x.shape == t.shape
    assert torch.equal(fetch(x), t)


@pytest.mark.parametrize("placements", [{"dp": Shard(0)}, {"tp": Shard(1), "dp": Partial()}, None])
def test_distribute_tensor_of_a_computed_tensor_is_differentiable(procs: ProcMesh, placements: Any) -> None:
    """Gradients reach the plain tensors it was computed from, as in plain torch; a leaf stays a leaf."""
    base = torch.randn(4, 3, requires_grad=True)
    ref = base.detach().clone().requires_grad_()
    other = torch.randn(4, 3)
    d = monarch.distribute_tensor(base * 2 + 1, procs, placements)
    assert not d.is_leaf and d.requires_grad
    (torch.sin(d) * monarch.distribute_tensor(other, procs)).sum().backward()
    (torch.sin(ref * 2 + 1) * other).sum().backward()
    assert type(base.grad) is torch.Tensor
    torch.testing.assert_close(base.grad, ref.grad)
    leaf = monarch.distribute_tensor(ref, procs, placements)
    assert leaf.is_leaf and leaf.requires_grad


def test_item_tolist_repr_fetch(procs: ProcMesh, capsys: pytest.CaptureFixture[str]) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    x = monarch.distribute_tensor(t, procs, {"dp": Shard(0), "tp": Shard(1)})
    assert x.sum().item() == 66.0
    assert x.tolist() == t.tolist()
    text = repr(x)
    assert "11." in text and "S(0)" in text and "S(1)" in text and "dp" in text
    print(x)
    assert "S(1)" in capsys.readouterr().out
    future = monarch.fetch(x * 2)
    value = future.get(timeout=T)
    assert type(value) is torch.Tensor and torch.equal(value, t * 2)


def test_repr_is_the_same_inside_and_outside_activate(procs: ProcMesh) -> None:
    """torch's printing makes tensors of its own: under activate() they stay plain (no nested MeshTensor)."""
    x = monarch.distribute_tensor(torch.arange(4.0), procs, {"dp": Shard(0)})
    outside = repr(x)
    with procs.activate():
        inside, printed = repr(x), str(x)
        assert isinstance(torch.ones(2), MeshTensor), "activate() holds after printing"
    assert outside == inside == printed
    assert outside.count("MeshTensor(") == 1 and outside.startswith("MeshTensor(tensor([0., 1., 2., 3.])")


def test_rank_tensors(procs: ProcMesh) -> None:
    for dim in ("dp", "tp"):
        r = procs.rank(dim)
        assert r.placements == tuple(Shard(0) if n == dim else R for n in ("dp", "tp"))
        assert torch.equal(fetch(r), torch.arange(2))
    if hasattr(monarch, "local_map"):  # every rank's local piece is its own index
        ident = monarch.local_map(lambda r: r.clone(), [{"dp": Shard(0)}], {"dp": Shard(0), "tp": Shard(0)})
        assert torch.equal(fetch(ident(procs.rank("dp"))), torch.tensor([0, 0, 1, 1]))


# -- collectives ------------------------------------------------------------------------------------

def test_column_then_row_parallel_linear_needs_one_all_reduce(procs: ProcMesh) -> None:
    x, w1, w2 = torch.randn(8, 6), torch.randn(6, 10), torch.randn(10, 4)
    mx = monarch.distribute_tensor(x, procs)
    m1 = monarch.distribute_tensor(w1, procs, {"tp": Shard(1)})
    m2 = monarch.distribute_tensor(w2, procs, {"tp": Shard(0)})
    s = synced(procs)
    before = len(s.collectives)
    h = torch.relu(mx @ m1)
    y = h @ m2
    assert isinstance(h, MeshTensor) and isinstance(y, MeshTensor)
    assert h.placements == (R, Shard(1)) and y.placements == (R, P)
    torch.testing.assert_close(fetch(y), torch.relu(x @ w1) @ w2)
    assert s.collectives[before:] == ["all_reduce[tp]"]


# -- in-place ops -----------------------------------------------------------------------------------

def test_inplace_ops_update_the_tensor(procs: ProcMesh) -> None:
    t, u = torch.randn(5, 6), torch.randn(5, 6)
    x = monarch.distribute_tensor(t.clone(), procs, {"tp": Shard(1)})
    y = monarch.distribute_tensor(u, procs, {"dp": Shard(0)})
    steps: list[tuple[Callable[[Any], Any], Callable[[torch.Tensor], Any]]] = [
        (lambda a: a.add_(1), lambda a: a.add_(1)),
        (lambda a: a.mul_(y), lambda a: a.mul_(u)),
        (lambda a: a.zero_(), lambda a: a.zero_()),
        (lambda a: a.copy_(y), lambda a: a.copy_(u)),
        (lambda a: a.fill_(3), lambda a: a.fill_(3)),
        (lambda a: a.sub_(y, alpha=2), lambda a: a.sub_(u, alpha=2)),
    ]
    for on_mesh, on_torch in steps:
        assert on_mesh(x) is x
        on_torch(t)
        torch.testing.assert_close(fetch(x), t)
    assert torch.equal(fetch(y), u)  # the other operand is unchanged


# -- local_map --------------------------------------------------------------------------------------

def test_local_map(procs: ProcMesh) -> None:
    if not hasattr(monarch, "local_map"):
        pytest.skip("monarch.local_map is not there yet")
    t = torch.randn(5, 4)
    x = monarch.distribute_tensor(t, procs, {"tp": Shard(1)})
    affine = monarch.local_map(lambda a: a * 2 + 1, [{"dp": Shard(0)}], {"dp": Shard(0)})
    y = affine(x)
    assert y.placements == (Shard(0), R)
    torch.testing.assert_close(fetch(y), t * 2 + 1)
    colsum = monarch.local_map(lambda a: a.sum(0, keepdim=True), [{"dp": Shard(0)}], {"dp": Partial()})
    torch.testing.assert_close(fetch(colsum(x)), t.sum(0, keepdim=True))


# -- errors -----------------------------------------------------------------------------------------

def test_shape_mismatch_fails_on_controller_before_shipping(procs: ProcMesh) -> None:
    a = monarch.randn(5, 7, mesh=procs, placements={"tp": Shard(1)})
    b = monarch.randn(3, 4, mesh=procs)
    s = session_of(procs)
    flushes, pending = s.flushes, s.tracer.n_ops
    with pytest.raises(monarch.ShapeError) as e:
        a @ b
    assert "mm" in str(e.value) and "[5, 7]" in str(e.value) and "[3, 4]" in str(e.value)
    with pytest.raises(monarch.ShapeError, match="add"):
        a + b
    assert s.flushes == flushes and s.tracer.n_ops == pending
    assert fetch(a).shape == (5, 7)  # the mesh still works


def test_unknown_mesh_dim_names_the_dims(procs: ProcMesh) -> None:
    with pytest.raises(monarch.ShardingError, match=r"pp.*\['dp', 'tp'\]"):
        monarch.randn(4, 4, mesh=procs, placements={"pp": Shard(0)})
    with pytest.raises(monarch.ShardingError, match="bogus"):
        monarch.distribute_tensor(torch.ones(2), procs, {"bogus": Shard(0)})
    with pytest.raises(monarch.ShardingError, match="pp"):
        monarch.zeros(2, mesh=procs).redistribute({"pp": R})
    with pytest.raises(monarch.ShardingError):
        monarch.zeros(2, mesh=procs, placements=[Shard(0)])  # one placement for two mesh dims


def test_tensors_of_two_meshes_do_not_mix(procs: ProcMesh) -> None:
    a = monarch.ones(4, mesh=procs)
    local = monarch.ones(4, mesh=LocalMesh({"dp": 2, "tp": 2}))
    half = monarch.ones(4, mesh=procs.slice(dp=0))
    s = session_of(procs)
    flushes = s.flushes
    for other in (local, half):
        with pytest.raises(monarch.ShardingError, match="two meshes"):
            a + other
        with pytest.raises(monarch.ShardingError, match="two meshes"):
            torch.cat([a, other])
    assert s.flushes == flushes
    assert torch.equal(fetch(a + a), torch.full((4,), 2.0))


def test_worker_failure_raises_remote_error_and_mesh_recovers(procs: ProcMesh) -> None:
    x = monarch.distribute_tensor(torch.randn(4, 3), procs, {"dp": Shard(0)})
    bad = monarch.distribute_tensor(torch.tensor([0, 99]), procs)
    s = session_of(procs)
    flushes = s.flushes
    y = torch.index_select(x, 1, bad)  # the meta check passes; the index is out of range on the workers
    z = y * 2 + 1  # reads the failed buffer
    assert s.flushes == flushes  # nothing ran yet: the error comes at the next sync point
    with pytest.raises(monarch.RemoteError) as e:
        fetch(z)
    err = e.value
    assert 0 <= err.rank < 4 and "index_select" in err.what and "index_select" in str(err)
    assert err.exc_type in ("IndexError", "RuntimeError") and err.exc_type in err.remote_traceback
    assert "out of" in err.remote_traceback
    good = torch.randn(3, 3)
    assert torch.equal(fetch(monarch.distribute_tensor(good, procs, {"tp": Shard(0)}) * 1), good)
    s.synchronize(T)  # the error was reported once


class BufferCount(Actor):
    """Counts the tensor engine's live buffers on its worker."""

    @endpoint
    def live(self) -> int:
        from monarch.runtime.control.client import client
        service = getattr(client(), "_tensors", None)
        return 0 if service is None else len(service.engine.store)


def test_temporaries_are_freed_on_workers(procs: ProcMesh) -> None:
    counter = procs.spawn("buffer_count", BufferCount)
    x = monarch.randn(16, 8, mesh=procs, placements={"dp": Shard(0), "tp": Shard(1)})
    w = monarch.randn(8, 8, mesh=procs, placements={"tp": Shard(0)})
    fetch(x)

    def live() -> list[int]:
        return counter.live.call().get(timeout=T).values()

    start = live()
    for i in range(90):
        x = torch.tanh(x @ w) + x * 0.5
        if i % 30 == 29:
            assert abs(x.sum().item()) < 1e4
            now = live()
            assert all(n <= s0 + 2 for n, s0 in zip(now, start, strict=True)), (start, now)
