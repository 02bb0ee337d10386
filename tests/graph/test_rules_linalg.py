"""Batched linear-algebra rules (graph/rules/linalg.py, addbmm and _trilinear in rules/matmul.py) against
plain torch: drawn batch shapes and placements on the reference mesh (batch shards stay sharded with no
collective, a shard of a matrix dim is gathered once), two-operand ops with broadcast and vector right-hand
sides, and on a real 4-process mesh the `info` checks: a failing matrix on one rank's batch piece raises
torch's own error on the controller, a passing check works sharded.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.errors import UnsupportedOpError
from monarch.runtime.session.session import session_of
from tests.graph.rule_cases import Case, check, examples, flat, run
from tests.strategies import reference_mesh

R = Replicate()
pytestmark = pytest.mark.usefixtures("strict")


def spd(*shape: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Symmetric positive-definite matrices of shape (*batch, n, n)."""
    a = torch.randn(shape, generator=gen)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def well_conditioned(*shape: int, gen: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(shape, generator=gen) + 2 * shape[-1] * torch.eye(shape[-1])


# one-matrix ops: (function, what kind of matrix it takes); outputs are made sign- and order-free where
# torch leaves them so (eigenvectors, singular vectors, Q and R)
ONE: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[..., torch.Tensor]]] = {
    "inv": (torch.linalg.inv, well_conditioned),
    "inv_ex": (torch.linalg.inv_ex, well_conditioned),
    "cholesky": (torch.linalg.cholesky, spd),
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a, upper=True), spd),
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), spd),
    "det": (torch.linalg.det, well_conditioned),
    "slogdet": (torch.linalg.slogdet, well_conditioned),
    "eigvalsh": (torch.linalg.eigvalsh, spd),
    "eigh": (lambda a: torch.linalg.eigh(a)[1].abs(), spd),
    "svdvals": (torch.linalg.svdvals, well_conditioned),
    "svd": (lambda a: torch.linalg.svd(a)[0].abs(), spd),
    "qr": (lambda a: torch.linalg.qr(a)[1].abs(), well_conditioned),
    "lu_factor": (torch.linalg.lu_factor_ex, well_conditioned),
    "lu": (torch.linalg.lu, well_conditioned),
    "ldl_factor": (torch.linalg.ldl_factor_ex, spd),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a / a.shape[-1] / 4), well_conditioned),
    "pinv": (torch.linalg.pinv, well_conditioned),
    "geqrf": (lambda a: torch.geqrf(a)[1].abs(), well_conditioned),
}


def gathered(case: Case, shape: tuple[int, ...], core: int) -> int:
    """On how many mesh dims the only input must move: where it is Partial, or sharded on a matrix dim or
    on a batch dim of size 1 (nothing to shard it by); a mesh dim of one rank moves nothing."""
    ndim = len(shape)
    return sum(n > 1 and (p.is_partial() or (isinstance(p, Shard) and (p.dim >= ndim - core or shape[p.dim] == 1)))
               for p, n in zip(case.placed[0], case.dims.values(), strict=True))


@pytest.mark.parametrize("name", sorted(ONE))
@examples(6)
def test_one_matrix(name: str, data: st.DataObject) -> None:
    c = Case(data)
    fn, make = ONE[name]
    batch = data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    n = data.draw(st.integers(1, 4))
    a = make(*batch, n, n, gen=c.gen)
    _, comms = c.run(fn, a)
    moving = gathered(c, a.shape, 2)
    # one collective per such mesh dim, and on a 2-d mesh a batch shard nested inside one on another
    assert moving <= len(comms) <= (moving and len(c.dims)), (comms, c.placed)


# two-operand ops: f(A, B) with A (*batch, n, n) and B (*batch, n, k)
TWO: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "solve": torch.linalg.solve,
    "solve_ex": torch.linalg.solve_ex,
    "solve_right": lambda a, b: torch.linalg.solve(a, b.mT, left=False),
    "lu_solve": lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
    "lu_solve_adjoint": lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True),
    "ldl_solve": lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a @ a.mT), b),
    "cholesky_solve": lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a @ a.mT)),
    "solve_triangular": lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True),
    "triangular_solve": lambda a, b: torch.triangular_solve(b, a.tril(), upper=False),
    "lstsq": lambda a, b: torch.linalg.lstsq(a, b, driver="gels").solution,
    "householder": lambda a, b: torch.linalg.householder_product(a, b[..., 0]),
    "ormqr": lambda a, b: torch.ormqr(*torch.geqrf(a), b),
}
BATCH = (Shard(0), Shard(1))  # on dp and tp: every operand's two batch dims


@pytest.mark.parametrize("name", sorted(TWO))
def test_two_operands_batch_sharded(name: str) -> None:
    """Both operands sharded on their batch dims: the result is, and nothing moves; B's row dim sharded on
    tp instead: one collective, and the result is still sharded on the batch over dp."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    gen = torch.Generator().manual_seed(0)
    a, b = well_conditioned(4, 3, 5, 5, gen=gen), torch.randn(4, 3, 5, 2, generator=gen)
    fn = TWO[name]
    got, comms = run(mesh, lambda x: fn(monarch.distribute_tensor(a, mesh, BATCH), x),
                     monarch.distribute_tensor(b, mesh, BATCH))
    check(got, fn(a, b), rtol=1e-4, atol=1e-4)
    assert comms == [], comms
    got, comms = run(mesh, lambda x: fn(monarch.distribute_tensor(a, mesh, BATCH), x),
                     monarch.distribute_tensor(b, mesh, (Shard(0), Shard(2))))
    check(got, fn(a, b), rtol=1e-4, atol=1e-4)
    assert len(comms) == 1, comms


def some_ones(data: st.DataObject, batch: list[int]) -> list[int]:
    """`batch` with some dims 1 and some leading dims dropped (a shape that broadcasts to it)."""
    ones = [n if data.draw(st.booleans()) else 1 for n in batch]
    return ones[data.draw(st.integers(0, len(ones))):]


@pytest.mark.parametrize("vector", [False, True])
@examples(15)
def test_solve_broadcast(vector: bool, data: st.DataObject) -> None:
    """linalg.solve_ex with drawn batch shapes that broadcast between A and B; B a vector or matrices."""
    c = Case(data)
    n = data.draw(st.integers(1, 4))
    batch = data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    a_batch = batch if vector else some_ones(data, batch)
    b_batch = batch if not vector or data.draw(st.booleans()) else []
    a = well_conditioned(*a_batch, n, n, gen=c.gen)
    b = c.randn(*b_batch, n) if vector else c.randn(*some_ones(data, batch), n, data.draw(st.integers(1, 3)))
    c.run(torch.linalg.solve_ex, a, b)


def test_unbatched_a_stays_replicated() -> None:
    """A without batch dims is replicated: its LU, pivots and info are the same on every rank; B's batch
    shards pass through to the solution, and nothing moves."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    a, b = well_conditioned(3, 3), torch.randn(6, 3, 2)
    solve = torch.ops.aten._linalg_solve_ex.default
    got, comms = run(mesh, lambda x: solve(monarch.distribute_tensor(a, mesh, (R, R)), x),
                     monarch.distribute_tensor(b, mesh, (Shard(0), Shard(0))))
    check(got, solve(a, b))
    assert comms == [], comms
    out = solve(monarch.distribute_tensor(a, mesh, (R, R)), monarch.distribute_tensor(b, mesh, (Shard(0), Shard(0))))
    assert [t.placements for t in out] == [(Shard(0), Shard(0))] + [(R, R)] * 3


def test_pinv_tolerance_tensors_broadcast() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    a, atol, rtol = torch.randn(4, 3, 5, 4), torch.rand(4, 3) * 0.5, torch.rand(3) * 0.1
    got, comms = run(mesh, lambda x: torch.linalg.pinv(x, atol=monarch.distribute_tensor(atol, mesh, BATCH),
                                                       rtol=monarch.distribute_tensor(rtol, mesh, (R, Shard(0)))),
                     monarch.distribute_tensor(a, mesh, BATCH))
    check(got, torch.linalg.pinv(a, atol=atol, rtol=rtol), rtol=1e-4, atol=1e-4)
    assert comms == [], comms


@pytest.mark.parametrize("driver", ["gels", "gelsy", "gelsd", "gelss"])
@pytest.mark.parametrize("rows", [3, 5])
def test_lstsq_drivers(driver: str, rows: int) -> None:
    """Every output (solution, residuals, ranks, singular values, or their empty stand-ins) as torch's, the
    batch sharded; gelsd and gelss with more rows than columns refuse: torch returns residuals only when
    every matrix has full rank, which the shapes cannot tell."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    a, b = torch.randn(4, 3, rows, 4), torch.randn(4, 3, rows, 2)
    fn = lambda x, y: tuple(torch.linalg.lstsq(x, y, driver=driver))  # noqa: E731
    put = lambda t: monarch.distribute_tensor(t, mesh, BATCH)  # noqa: E731
    a = a[..., :3] if rows == 5 else a
    if rows == 5 and driver in ("gelsd", "gelss"):
        with pytest.raises(UnsupportedOpError, match="full rank|ranks of the matrices"):
            fn(put(a), put(b))
        return
    got, comms = run(mesh, lambda y: fn(put(a), y), put(b))
    check(got, fn(a, b), rtol=1e-3, atol=1e-3)
    assert comms == [], comms


def test_addbmm_batch_shards_sum_partially() -> None:
    """addbmm over a sharded batch: each rank multiplies its matrices, the sum is Partial until read."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    x, b1, b2 = torch.randn(3, 4), torch.randn(6, 3, 5), torch.randn(6, 5, 4)
    put = monarch.distribute_tensor
    out = torch.addbmm(put(x, mesh, (R, R)), put(b1, mesh, (Shard(0), Shard(1))), put(b2, mesh, (Shard(0), R)),
                       beta=0.5, alpha=2.0)
    assert out.placements == (Partial("sum"), Shard(0))
    check([out.full_tensor(timeout=30)], torch.addbmm(x, b1, b2, beta=0.5, alpha=2.0))


@examples(15)
def test_bilinear(data: st.DataObject) -> None:
    c = Case(data)
    n, i1, i2, o = (data.draw(st.integers(1, 5)) for _ in range(4))
    bias = c.randn(o) if data.draw(st.booleans()) else None
    _, comms = c.run(lambda x, y, w, b: torch.nn.functional.bilinear(x, y, w, b),
                     c.randn(n, i1), c.randn(n, i2), c.randn(o, i1, i2), bias)
    sharded_inputs = any(isinstance(p, (Shard, Partial)) for ps in c.placed for p in ps)
    if not sharded_inputs:
        assert comms == [], comms


# -- the info checks on a real mesh -----------------------------------------------------------------
FAILING = {
    "inv": (torch.linalg.inv, well_conditioned, "singular"),
    "cholesky": (torch.linalg.cholesky, spd, "not positive-definite"),
    "solve": (lambda a: torch.linalg.solve(a, a[..., 0]), well_conditioned, "singular"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FAILING))
def test_failing_check_raises_on_the_controller(procs: Any, name: str) -> None:
    """One matrix of the batch (on rank 3's piece) fails: torch's own error, naming the batch element, is
    raised on the controller; the mesh keeps working, and a passing check runs with the batch sharded."""
    fn, make, why = FAILING[name]
    a = make(8, 3, 3)
    bad = a.clone()
    bad[7] = -torch.eye(3) if name == "cholesky" else 0
    placed = (Shard(0), Shard(0))
    with pytest.raises(torch.linalg.LinAlgError) as plain:
        fn(bad)
    with pytest.raises(torch.linalg.LinAlgError, match=why) as got:
        fn(monarch.distribute_tensor(bad, procs, placed))
    assert str(got.value) == str(plain.value)
    assert "Batch element 7" in str(got.value)
    s = session_of(procs)
    s.flush()
    before = len(s.collectives)
    out = fn(monarch.distribute_tensor(a, procs, placed))
    assert out.placements == placed
    torch.testing.assert_close(out.full_tensor(timeout=30), fn(a), rtol=1e-4, atol=1e-4)
    assert s.collectives[before:] == []


@pytest.mark.timeout(120)
def test_ex_variants_report_info_sharded(procs: Any) -> None:
    """The _ex variants do not raise: their info stays sharded with the batch and equals torch's."""
    a = well_conditioned(8, 3, 3)
    a[2] = 0
    placed = (Shard(0), Shard(0))
    got = [t.full_tensor(timeout=30) for t in flat(torch.linalg.inv_ex(monarch.distribute_tensor(a, procs, placed)))]
    want = torch.linalg.inv_ex(a)
    torch.testing.assert_close(got[1], want.info)
    assert int(got[1][2]) != 0
    torch.testing.assert_close(got[0][3:], want.inverse[3:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["inv_ex", "cholesky_ex", "svdvals", "lu_factor", "eigh"])
def test_empty_pieces(procs: Any, name: str) -> None:
    """3 matrices over 4 ranks: one rank's batch piece is empty, the results still equal torch's."""
    fn, make = ONE[name]
    a = make(3, 4, 4)
    out = fn(monarch.distribute_tensor(a, procs, (Shard(0), Shard(0))))
    assert flat(out)[0].placements == (Shard(0), Shard(0))
    check([t.full_tensor(timeout=30) for t in flat(out)], fn(a))
