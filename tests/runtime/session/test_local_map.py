"""local_map on real worker processes: each rank's result is checked against the plan traced on meta tensors.

A function whose real result differs in shape, dtype or kind from what it gave on meta tensors poisons
its value with a RemoteError naming the rank, the planned and the actual result and the function; the
error comes at the next sync point (also for values computed from it) and the mesh keeps working.
Correct functions, uneven shards included, pass, eagerly and compiled.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import tensor_shapes

import monarch
from monarch import MeshTensor, Partial, Replicate, Shard
from monarch.actor import ProcMesh

T = 30.0  # seconds any single wait may take
DP = [{"dp": Shard(0)}]


def fetch(t: MeshTensor) -> torch.Tensor:
    return t.full_tensor(timeout=T)


def remote_error(read: Callable[[], Any]) -> monarch.RemoteError:
    with pytest.raises(monarch.RemoteError) as e:
        read()
    return e.value


def assert_mesh_answers(procs: ProcMesh) -> None:
    t = torch.randn(5, 3)
    assert torch.equal(fetch(monarch.distribute_tensor(t, procs, {"dp": Shard(0)}) * 1), t)
    monarch.synchronize(procs, T)  # every error was reported once


def rows(procs: ProcMesh, n: int = 8) -> tuple[torch.Tensor, MeshTensor]:
    t = torch.arange(float(n * 2)).reshape(n, 2)
    return t, monarch.distribute_tensor(t, procs, {"dp": Shard(0)})


def test_shape_differing_from_the_plan_poisons_the_result(procs: ProcMesh) -> None:
    _, x = rows(procs)

    def first_row(a: torch.Tensor) -> torch.Tensor:
        return a if a.is_meta else a[:1]
    y = monarch.local_map(first_row, DP, {"dp": Shard(0)})(x)
    err = remote_error(lambda: y.sum().item())
    assert 0 <= err.rank < 4 and err.what == "monarch::local_map"
    msg = str(err)
    assert f"rank {err.rank}" in msg and "first_row" in msg
    assert "planned shape (4, 2) torch.float32" in msg and "shape (1, 2) torch.float32 here" in msg
    assert err.exc_type == "ShardingError" and "is_meta" in msg
    assert remote_error(lambda: fetch(y)).rank == err.rank  # reading the value itself raises too
    assert_mesh_answers(procs)


def test_dtype_differing_from_the_plan_poisons_what_reads_it(procs: ProcMesh) -> None:
    _, x = rows(procs)
    y = monarch.local_map(lambda a: a if a.is_meta else a.double(), DP, {"dp": Shard(0)})(x)
    z = (y * 2).redistribute({"dp": Replicate()}) + 1  # computed from it, through a collective
    msg = str(remote_error(lambda: fetch(z)))
    assert "<lambda>" in msg and "planned shape (4, 2) torch.float32" in msg
    assert "shape (4, 2) torch.float64 here" in msg
    assert_mesh_answers(procs)


def test_non_tensor_and_wrong_count_results(procs: ProcMesh) -> None:
    _, x = rows(procs)
    number = monarch.local_map(lambda a: a if a.is_meta else float(a.sum()), DP, {"dp": Shard(0)})(x)
    assert "result 0 has float " in str(remote_error(lambda: fetch(number)))
    one, two = monarch.local_map(lambda a: (a, a) if a.is_meta else (a,), DP, [{"dp": Shard(0)}] * 2)(x)
    assert "returned 1 results here, but tracing it on meta tensors gave 2" in str(
        remote_error(lambda: fetch(two)))
    assert_mesh_answers(procs)


def test_each_rank_is_checked_against_its_own_uneven_plan(procs: ProcMesh) -> None:
    _, x = rows(procs, 5)  # dp=0 holds 3 rows, dp=1 holds 2
    y = monarch.local_map(lambda a: a if a.is_meta else a[:2], DP, {"dp": Shard(0)})(x)
    err = remote_error(lambda: fetch(y))
    assert err.rank in (0, 1) and err.coords.startswith("dp=0")  # dp=1's two rows are what it planned
    assert "planned shape (3, 2)" in str(err) and "shape (2, 2) torch.float32 here" in str(err)
    assert_mesh_answers(procs)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=tensor_shapes(max_dims=2), data=st.data())
def test_correct_functions_pass_on_uneven_shards(procs: ProcMesh, shape: tuple[int, ...], data: st.DataObject) -> None:
    t = torch.randn(shape)
    d = data.draw(st.integers(0, len(shape) - 1))
    x = monarch.distribute_tensor(t, procs, {"tp": Shard(d)})
    ins = [{"dp": Shard(d), "tp": Replicate()}]
    affine = monarch.local_map(lambda a: a * 2 + 1, ins, {"dp": Shard(d)})
    torch.testing.assert_close(fetch(affine(x)), t * 2 + 1)
    pieces = monarch.local_map(lambda a: (a.sum(d, keepdim=True), a.to(torch.float64)), ins,
                               [{"dp": Partial()}, {"dp": Shard(d)}])
    total, wide = pieces(x)
    torch.testing.assert_close(fetch(total), t.sum(d, keepdim=True))
    assert torch.equal(fetch(wide), t.double())


def test_compiled_local_map_is_checked_and_correct_one_runs(procs: ProcMesh) -> None:
    t, x = rows(procs, 6)
    good = monarch.local_map(lambda a: a * 3, DP, {"dp": Shard(0)})
    bad = monarch.local_map(lambda a: a if a.is_meta else a[1:], DP, {"dp": Shard(0)})

    @monarch.compile
    def step(a: MeshTensor) -> tuple[MeshTensor, MeshTensor]:
        return good(a).sum(), bad(a).sum()
    for _ in range(2):  # the recording call and a replay of the installed program
        g, b = step(x)
        assert "planned shape (3, 2)" in str(remote_error(lambda: b.item()))
        assert g.item() == pytest.approx(float((t * 3).sum()))
    assert_mesh_answers(procs)


# -- gradients ----------------------------------------------------------------------------------------

def leaves(procs: ProcMesh, *pairs: tuple[torch.Tensor, Any]) -> tuple[list[torch.Tensor], list[MeshTensor]]:
    """Plain leaves that require grad and MeshTensor leaves of the same data, placed as given."""
    plain = [t.clone().requires_grad_() for t, _ in pairs]
    mesh = [monarch.distribute_tensor(t.detach(), procs, p).requires_grad_() for t, (_, p) in zip(plain, pairs)]
    return plain, mesh


def assert_grads(mesh: list[MeshTensor], plain: list[torch.Tensor]) -> None:
    for m, p in zip(mesh, plain, strict=True):
        assert m.grad is not None, "the local_map branch got no gradient"
        torch.testing.assert_close(fetch(m.grad), p.grad)


def test_gradients_flow_through_local_map_in_a_loss_with_other_terms(procs: ProcMesh) -> None:
    torch.manual_seed(0)
    plain, mesh = leaves(procs, (torch.randn(6, 4), {"dp": Shard(0)}), (torch.randn(4, 3), None))
    layer = monarch.local_map(lambda a, w: torch.tanh(a @ w), [DP[0], None], {"dp": Shard(0)})
    for (x, w), f in ((mesh, layer), (plain, lambda a, w: torch.tanh(a @ w))):
        y = f(x, w)
        assert y.requires_grad
        loss = y.pow(2).mean() + w.square().sum() * 0.1 + x.sum() * 0.01
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward through the kept graph, as torch allows
    assert mesh[1].grad.placements == (Partial(), Partial())  # each rank's contribution, summed when read
    assert_grads(mesh, plain)


def test_local_map_gradients_for_every_output_placement(procs: ProcMesh) -> None:
    """Sharded, replicated and Partial outputs of one call; a weight sharded over tp, an input replicated
    over it (its gradient sums the tp ranks' contributions)."""
    torch.manual_seed(1)
    plain, mesh = leaves(procs, (torch.randn(6, 4), {"dp": Shard(0)}), (torch.randn(4, 6), {"tp": Shard(1)}))

    def fn(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = a @ w
        return h.sin(), w.exp(), h.sum(0, keepdim=True), a.argmax(1)
    outs = [{"dp": Shard(0), "tp": Shard(1)}, {"tp": Shard(1)}, {"dp": Partial(), "tp": Shard(1)}, {"dp": Shard(0)}]
    got = monarch.local_map(fn, [None, None], outs)(*mesh)
    assert not got[3].requires_grad  # an integer result takes no gradient
    (got[0].pow(2).sum() + got[1].sum() + got[2].pow(2).sum()).backward()
    a, w = plain
    h = a @ w
    (h.sin().pow(2).sum() + w.exp().sum() + h.sum(0, keepdim=True).pow(2).sum()).backward()
    assert_grads(mesh, plain)
    assert mesh[1].grad.placements == (Partial(), Shard(1))


def test_no_tape_without_gradients(procs: ProcMesh) -> None:
    _, x = rows(procs)
    with torch.no_grad():
        y = monarch.local_map(lambda a: a * 2, DP, {"dp": Shard(0)})(x.requires_grad_())
    assert not y.requires_grad and torch.equal(fetch(y), fetch(x) * 2)
