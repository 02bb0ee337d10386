"""Special functions (graph/rules/pointwise.py): the pointwise `special_*` ops (Bessel functions, orthogonal
polynomials with a tensor or scalar degree) against plain torch on the reference mesh for random shapes and
placements, with no data moved when nothing is Partial; elementwise prims on a real mesh; the table claims
only ops torch makes elementwise.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

import monarch
from monarch import Shard
from monarch.actor import ProcMesh
from monarch.graph.rules import pointwise
from monarch.graph.rules.table import RULES
from tests.graph.rule_cases import Case, examples
from tests.strategies import tensor_shapes

aten, prims, special = torch.ops.aten, torch.ops.prims, torch.special
pytestmark = pytest.mark.usefixtures("strict")

UNARY: dict[str, Callable[[Any], Any]] = {
    "airy_ai": special.airy_ai, "bessel_j0": special.bessel_j0, "bessel_y1": special.bessel_y1,
    "erfcx": special.erfcx, "i1e": special.i1e, "log_ndtr": special.log_ndtr,
    "modified_bessel_k0": special.modified_bessel_k0, "ndtri": lambda x: special.ndtri(torch.sigmoid(x)),
    "scaled_modified_bessel_k1": lambda x: special.scaled_modified_bessel_k1(x.abs() + 0.1),
    "spherical_bessel_j0": special.spherical_bessel_j0,
}
POLYNOMIALS = sorted(["chebyshev_polynomial_t", "chebyshev_polynomial_w", "hermite_polynomial_he",
                      "laguerre_polynomial_l", "legendre_polynomial_p", "shifted_chebyshev_polynomial_u"])


@pytest.mark.parametrize("name", sorted(UNARY))
@examples(15)
def test_unary_special(name: str, data: st.DataObject) -> None:
    c = Case(data)
    _, comms = c.run(UNARY[name], c.randn(*data.draw(tensor_shapes(1, 3, 1, 6))))
    if c.plain_placements():
        assert comms == [], f"{name} moved data: {comms}"


@pytest.mark.parametrize("name", POLYNOMIALS)
@examples(15)
def test_polynomial_with_tensor_or_scalar_degree(name: str, data: st.DataObject) -> None:
    """(x, n): both tensors (n broadcasting over x's last dims), or one of them a Python number (nothing
    moves then unless the tensor is Partial)."""
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 6))
    x = c.randn(*shape).clamp(-1, 1)
    n = torch.randint(0, 6, shape[data.draw(st.integers(0, len(shape) - 1)):], generator=c.gen).float()
    fn = getattr(special, name)
    kind = data.draw(st.sampled_from(["tensors", "x_scalar", "n_scalar"]))
    if kind == "tensors":
        _, comms = c.run(fn, x, n)
    elif kind == "x_scalar":
        _, comms = c.run(lambda t: fn(0.3, t), n)
    else:
        _, comms = c.run(lambda t: fn(t, 3), x)
    if c.plain_placements() and kind != "tensors":  # two tensors may be placed differently
        assert comms == [], f"{name} ({kind}) moved data: {comms}"


def test_elementwise_prims_on_a_real_mesh(procs: ProcMesh) -> None:
    """The prims that the decompositions of special functions reach run on the workers, sharded as given."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(6, 5, generator=gen) + 1.5, torch.rand(6, 5, generator=gen) + 0.5
    placements = {"dp": Shard(0), "tp": Shard(1)}
    mx, my = (monarch.distribute_tensor(t, procs, placements) for t in (x, y))
    for op in (prims.bessel_j0, prims.bessel_i1e, prims.erfcx, prims.ndtri, prims.spherical_bessel_j0):
        arg = (x - 1.5) * 0.9 + 0.05 if op is prims.ndtri else x
        out = op.default(monarch.distribute_tensor(arg, procs, placements))
        assert out.placements == (Shard(0), Shard(1)), (op, out.placements)
        torch.testing.assert_close(out.full_tensor(timeout=30), op.default(arg), rtol=1e-5, atol=1e-6)
    zeta = prims.zeta.default(mx, my)
    assert zeta.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(zeta.full_tensor(timeout=30), prims.zeta.default(x, y), rtol=1e-5, atol=1e-6)


def test_table_claims_only_elementwise_ops() -> None:
    """Every special_* op and prim with the pointwise rule is tagged pointwise (a prim: or elementwise by its
    meta); reductions, views and random draws among them do not have it."""
    elementwise = torch._prims._prim_elementwise_meta
    for op, rule in RULES.items():
        name = str(op.name())
        if rule is not pointwise.pointwise:
            continue
        if name.startswith("aten::special_"):
            assert torch.Tag.pointwise in op.tags, name
        elif name.startswith("prims::"):
            meta = getattr(getattr(op, "prim_meta_impl", None), "func", None)
            assert torch.Tag.pointwise in op.tags or meta is elementwise, name
    for op in (aten.special_logsumexp.default, aten.special_log_softmax.default, prims.sum.default,
               prims.view_of.default, prims.broadcast_in_dim.default, prims.normal.default, prims.where.default):
        assert RULES.get(op) is not pointwise.pointwise, op
    claimed = {aten.special_bessel_y0.default, aten.special_chebyshev_polynomial_t.x_scalar,
               aten.special_zeta.self_scalar, prims.bessel_j1.default, prims.erfcx.default, prims.zeta.default}
    assert claimed <= set(RULES), claimed - set(RULES)
