"""FFT rules (graph/rules/signal.py): real and complex transforms against plain torch on the reference mesh
for random shapes, dims and placements, with no data moved when only untransformed dims are sharded;
complex MeshTensors on a real mesh (sharded, gathered, Partial, conjugated, fetched); the rule itself on
hand-built specs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.actor import ProcMesh
from monarch.graph.rules.table import RULES, OpCall
from monarch.shape import Extent
from monarch.tensor.spec import Spec
from tests.graph.rule_cases import Case, examples
from tests.strategies import tensor_shapes

aten, fft = torch.ops.aten, torch.fft
R, P = Replicate(), Partial("sum")
pytestmark = pytest.mark.usefixtures("strict")

# fn(x, dims): a real result from a real input, through complex intermediates
OPS: dict[str, Callable[[Any, list[int]], Any]] = {
    "rfft_irfft": lambda x, d: fft.irfft(fft.rfft(x, dim=d[0]), n=x.shape[d[0]], dim=d[0]),
    "irfft": lambda x, d: fft.irfft(x, dim=d[0]),
    "hfft": lambda x, d: fft.hfft(x, dim=d[0]),
    "irfftn": lambda x, d: fft.irfftn(x, dim=d),
    "hfftn": lambda x, d: fft.hfftn(x, dim=d),
    "fft_abs": lambda x, d: fft.fftn(x, dim=d).abs(),
    "rfftn_real": lambda x, d: torch.view_as_real(fft.rfftn(x, dim=d, norm="ortho")).sum(-1),
}


@pytest.mark.parametrize("name", sorted(OPS))
@examples(15)
def test_transform_matches_torch(name: str, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 2, 6))
    dims = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape))))
    _, comms = c.run(lambda t: OPS[name](t, dims), c.randn(*shape))
    if c.plain_placements() and not any(isinstance(p, Shard) and p.dim in dims for p in c.placed[0]):
        assert comms == [] or name == "rfftn_real", f"{name} over {dims} moved data: {comms}"


def test_complex_mesh_tensors_on_a_real_mesh(procs: ProcMesh) -> None:
    """A complex result stays sharded on the untransformed dim, is fetched whole, gathered (its lazy
    conjugate too) and summed as a Partial; transforming a sharded dim gathers it first."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    mx = monarch.distribute_tensor(x, procs, {"dp": Shard(0), "tp": Shard(1)})
    spectrum = fft.rfft(mx, dim=1)
    assert spectrum.dtype == torch.complex64 and spectrum.placements == (Shard(0), Shard(0))
    torch.testing.assert_close(spectrum.full_tensor(timeout=30), fft.rfft(x, dim=1))
    conj = spectrum.conj().redistribute({"dp": R, "tp": Shard(1)})
    torch.testing.assert_close(conj.full_tensor(timeout=30), fft.rfft(x, dim=1).conj())
    torch.testing.assert_close(fft.hfft(mx, dim=0).full_tensor(timeout=30), fft.hfft(x, dim=0),
                               rtol=1e-4, atol=1e-4)
    parts = monarch.distribute_tensor(x, procs, {"dp": P, "tp": Shard(0)})
    summed = fft.fft(parts, dim=1)
    assert summed.placements == (P, Shard(0))
    torch.testing.assert_close(summed.full_tensor(timeout=30), fft.fft(x, dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fft.irfft(summed, dim=1).full_tensor(timeout=30), fft.irfft(fft.fft(x, dim=1), dim=1),
                               rtol=1e-4, atol=1e-4)


def test_rule_shards_only_untransformed_dims() -> None:
    mesh = Extent(("x",), (2,))
    x = Spec((4, 6, 8), (48, 8, 1), torch.float32, (R,), mesh)
    out = Spec((4, 6, 5), (30, 5, 1), torch.complex64, (R,), mesh)
    call = OpCall(aten._fft_r2c.default, (x, [0, -1], 0, True), {}, (x,), (out,))
    assert [(s.inputs, s.outputs) for s in RULES[aten._fft_r2c.default](call, 0)] == [((Shard(1),), (Shard(1),))]
    parts = Spec((4, 6, 8), (48, 8, 1), torch.float32, (P,), mesh)
    call = OpCall(aten._fft_r2c.default, (parts, [2], 0, True), {}, (parts,), (out,))
    assert ((P,), (P,)) in [(s.inputs, s.outputs) for s in RULES[aten._fft_r2c.default](call, 0)]
    maxes = Spec((4, 6, 8), (48, 8, 1), torch.float32, (Partial("max"),), mesh)  # fft(max) != max(fft)
    for op, args in ((aten._fft_r2c.default, (maxes, [2], 0, True)), (aten._conj.default, (maxes,))):
        call = OpCall(op, args, {}, (maxes,), (out,))
        assert all(not s.outputs[0].is_partial() for s in RULES[op](call, 0)), op


@examples(15)
def test_complex_views(data: st.DataObject) -> None:
    """view_as_real and view_as_complex keep the shards of the dims they keep, Partial too."""
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 5))
    _, comms = c.run(lambda t: torch.view_as_complex(t) * 2, c.randn(*shape, 2))
    if c.plain_placements() and all(p != Shard(len(shape)) for p in c.placed[0]):
        assert comms == [], comms
    c.run(lambda t: torch.view_as_real(fft.rfft(t, dim=0)).sum(-1), c.randn(*shape))
