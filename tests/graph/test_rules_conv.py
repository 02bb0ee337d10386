"""Convolution, pooling, upsampling, pad and embedding_bag rules (graph/rules/conv.py) on the reference
mesh: values and backward ops against plain torch for random shapes (uneven and empty pieces) and
placements; the placements and collectives of batch, out-channel and in-channel sharding.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from tests.graph.rule_cases import Case, examples, flat
from tests.strategies import reference_mesh

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")
pytestmark = pytest.mark.usefixtures("strict")


def comms(mesh: Any, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    before = len(mesh.session.collectives)
    out = fn()
    return out, mesh.session.collectives[before:]


# -- convolution ------------------------------------------------------------------------------------
@st.composite
def conv_params(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2]))
    transposed = draw(st.booleans())
    stride, dilation = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    return dict(k=k, groups=groups, transposed=transposed, stride=[stride] * k, padding=[draw(st.integers(0, 1))] * k,
                dilation=[dilation] * k, output_padding=[stride - 1 if transposed and dilation == 1 else 0] * k,
                cin=groups * draw(st.integers(1, 3)), cout=groups * draw(st.integers(1, 3)),
                batch=draw(st.integers(1, 5)), size=draw(st.integers(3, 5)), bias=draw(st.booleans()))


def conv_tensors(c: Case, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k, g = p["k"], p["groups"]
    wshape = (p["cin"], p["cout"] // g) if p["transposed"] else (p["cout"], p["cin"] // g)
    x = c.randn(p["batch"], p["cin"], *[p["size"]] * k)
    return x, c.randn(*wshape, *[2] * k), c.randn(p["cout"]) if p["bias"] else None


def conv(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    return lambda x, w, b: aten.convolution(x, w, b, p["stride"], p["padding"], p["dilation"], p["transposed"],
                                            p["output_padding"], p["groups"])


@examples(40)
def test_convolution(data: st.DataObject) -> None:
    c = Case(data)
    p = data.draw(conv_params())
    c.run(conv(p), *conv_tensors(c, p))


@examples(40)
def test_convolution_backward(data: st.DataObject) -> None:
    c = Case(data)
    p = data.draw(conv_params())
    x, w, b = conv_tensors(c, p)
    g = torch.randn_like(conv(p)(x, w, b))
    mask = [data.draw(st.booleans()), data.draw(st.booleans()), p["bias"]]
    mask[0] = mask[0] or not any(mask)

    def backward(g: Any, x: Any, w: Any) -> list[Any]:
        outs = aten.convolution_backward(g, x, w, [p["cout"]] if p["bias"] else None, p["stride"], p["padding"],
                                         p["dilation"], p["transposed"], p["output_padding"], p["groups"], mask)
        return [o for o, on in zip(outs, mask, strict=True) if on]  # CPU kernels may fill unasked ones
    c.run(backward, g, x, w)


def test_conv_placements_and_collectives() -> None:
    """Batch shard: batch-sharded output, nothing moves; out-channel shard: channel-sharded output; in-channel
    shard of input and weight: a Partial output (one all_reduce when fetched). Pieces include empty ones."""
    mesh = reference_mesh({"x": 4})
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 3, 6, 6), torch.randn(5, 3, 3, 3), torch.randn(5)
    want = F.conv2d(x, w, b, padding=1)
    cases = [((Shard(0), R, R), Shard(0), []), ((R, Shard(0), Shard(0)), Shard(1), []),
             ((Shard(1), Shard(1), R), P, ["all_reduce[x]"])]
    for placed, out_p, moved in cases:
        args = [monarch.distribute_tensor(t, mesh, {"x": p}) for t, p in zip((x, w, b), placed, strict=True)]
        out, shipped = comms(mesh, lambda: F.conv2d(*args, padding=1))
        assert out.placements == (out_p,)
        got, shipped_fetch = comms(mesh, lambda: out.full_tensor(timeout=30))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert shipped == [] and shipped_fetch == moved, (placed, shipped, shipped_fetch)


def test_conv_backward_batch_shard_gives_partial_parameter_grads() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    torch.manual_seed(1)
    x, w, g = torch.randn(3, 4, 5, 5), torch.randn(6, 4, 3, 3), torch.randn(3, 6, 3, 3)
    want = aten.convolution_backward(g, x, w, [6], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True] * 3)
    dx = monarch.distribute_tensor(x, mesh, {"dp": Shard(0), "tp": Shard(1)})
    dw = monarch.distribute_tensor(w, mesh, {"tp": Shard(1)})
    dg = monarch.distribute_tensor(g, mesh, {"dp": Shard(0)})
    got, shipped = comms(mesh, lambda: aten.convolution_backward(dg, dx, dw, [6], [1, 1], [0, 0], [1, 1], False,
                                                                 [0, 0], 1, [True] * 3))
    assert shipped == []
    assert [t.placements for t in got] == [(Shard(0), Shard(1)), (P, Shard(1)), (P, R)]
    for t, want_t in zip(got, want, strict=True):
        torch.testing.assert_close(t.full_tensor(timeout=30), want_t, rtol=1e-4, atol=1e-5)


# -- pooling, upsampling, pads ----------------------------------------------------------------------
POOLS: dict[str, Callable[[torch.Tensor], Any]] = {
    "max_pool1d": lambda x: F.max_pool1d(x, 2),
    "max_pool2d": lambda x: F.max_pool2d(x, 2, 1, 1),
    "max_pool2d_indices": lambda x: F.max_pool2d(x, 2, return_indices=True),
    "max_pool3d_indices": lambda x: F.max_pool3d(x, 2, return_indices=True),
    "avg_pool1d": lambda x: F.avg_pool1d(x, 2),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg_pool3d": lambda x: F.avg_pool3d(x, 2, divisor_override=3),
    "adaptive_avg_pool1d": lambda x: F.adaptive_avg_pool1d(x, 3),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
    "adaptive_avg_pool3d": lambda x: F.adaptive_avg_pool3d(x, 2),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, 3, return_indices=True),
    "adaptive_max_pool3d": lambda x: F.adaptive_max_pool3d(x, 2),
    "max_unpool2d": lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2),
    "max_unpool3d": lambda x: F.max_unpool3d(*F.max_pool3d(x, 2, return_indices=True), 2),
    "fractional_max_pool2d": lambda x: F.fractional_max_pool2d(x, 2, output_size=3, return_indices=True,
                                                               _random_samples=samples(x)),
    "fractional_max_pool3d": lambda x: F.fractional_max_pool3d(x, 2, output_size=2, _random_samples=samples(x)),
    "nearest": lambda x: F.interpolate(x, scale_factor=2),
    "nearest_exact": lambda x: F.interpolate(x, size=(5, 7), mode="nearest-exact"),
    "linear": lambda x: F.interpolate(x, size=7, mode="linear"),
    "bilinear": lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True),
    "bilinear_aa": lambda x: F.interpolate(x, size=(3, 3), mode="bilinear", antialias=True),
    "bicubic": lambda x: F.interpolate(x, size=(6, 5), mode="bicubic"),
    "trilinear": lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"),
    "nearest3d": lambda x: F.interpolate(x, size=(2, 3, 5), mode="nearest"),
    "constant_pad": lambda x: F.pad(x, (1, 2), value=0.5),
    "reflect_pad1d": lambda x: F.pad(x, (1, 2), mode="reflect"),
    "reflect_pad2d": lambda x: F.pad(x, (1, 1, 2, 0), mode="reflect"),
    "replicate_pad2d": lambda x: F.pad(x, (0, 0, 2, 1), mode="replicate"),
    "replicate_pad3d": lambda x: F.pad(x, (1, 0, 1, 0, 0, 1), mode="replicate"),
}

NO_META_BACKWARD = {"fractional_max_pool3d"}  # torch has no meta kernel of its backward to trace it with


def samples(x: torch.Tensor) -> torch.Tensor:
    """Fixed (N, C, 2) random samples of a fractional max pool of x."""
    return torch.rand(x.shape[0], x.shape[1], x.ndim - 2, generator=torch.Generator().manual_seed(x.shape[0]))


def spatial(name: str) -> int:
    """The number of spatial dims POOLS[name] works on."""
    return 1 if "1d" in name or name == "linear" else 3 if "3d" in name or name == "trilinear" else 2


def leading_shard_cases() -> list[tuple[str, int]]:
    return [(name, d) for name in sorted(POOLS) for d in (0, 1)]


@pytest.mark.parametrize("name", sorted(POOLS))
@examples(10)
def test_pool_upsample_pad_forward(name: str, data: st.DataObject) -> None:
    c = Case(data)
    lead = [data.draw(st.integers(1, 5)) for _ in range(2)]
    c.run(POOLS[name], c.randn(*lead, *[4] * spatial(name)))


@pytest.mark.parametrize("name, d", leading_shard_cases())
def test_leading_shards_move_nothing_even_with_empty_pieces(name: str, d: int) -> None:
    """Batch or channel over 4 ranks (3 rows: pieces of 1, 1, 1 and 0): outputs stay sharded, no collective;
    the backward ops (through autograd) too."""
    mesh = reference_mesh({"x": 4})
    base = torch.randn(3, 3, *[4] * spatial(name), requires_grad=True)
    fn = POOLS[name]
    x = monarch.distribute_tensor(base.detach(), mesh, {"x": Shard(d)}).requires_grad_()
    out, shipped = comms(mesh, lambda: fn(x))
    want = fn(base)
    assert shipped == [] and all(t.placements == (Shard(d),) for t in flat(out)), (shipped, flat(out))
    for g, w in zip(flat(out), flat(want), strict=True):
        torch.testing.assert_close(g.full_tensor(timeout=30), w, rtol=1e-4, atol=1e-5)
    if name in NO_META_BACKWARD:
        return
    grad = torch.randn_like(flat(want)[0])
    flat(want)[0].backward(grad)
    _, shipped = comms(mesh, lambda: flat(out)[0].backward(monarch.distribute_tensor(grad, mesh, {"x": Shard(d)})))
    assert shipped == [] and x.grad.placements == (Shard(d),), shipped
    torch.testing.assert_close(x.grad.full_tensor(timeout=30), base.grad, rtol=1e-4, atol=1e-5)


BACKWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "avg_pool2d": lambda g, x: aten.avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0], False, True, None),
    "adaptive_avg_pool2d": lambda g, x: aten._adaptive_avg_pool2d_backward(g, x),
    "upsample_bilinear2d": lambda g, x: aten.upsample_bilinear2d_backward(g, [8, 8], list(x.shape), False),
    "upsample_nearest2d": lambda g, x: aten.upsample_nearest2d_backward(g, [8, 8], list(x.shape)),
    "reflection_pad2d": lambda g, x: aten.reflection_pad2d_backward(g, x, [1, 1, 2, 2]),
    "replication_pad2d": lambda g, x: aten.replication_pad2d_backward(g, x, [1, 1, 2, 2]),
}
GRAD_SHAPE = {"avg_pool2d": (2, 2), "adaptive_avg_pool2d": (4, 4), "upsample_bilinear2d": (8, 8),
              "upsample_nearest2d": (8, 8), "reflection_pad2d": (8, 6), "replication_pad2d": (8, 6)}


@pytest.mark.parametrize("name", sorted(BACKWARDS))
@examples(15)
def test_backward_ops(name: str, data: st.DataObject) -> None:
    """The backward ops on drawn placements of grad_output (Partial included) and input."""
    c = Case(data)
    lead = [data.draw(st.integers(1, 5)) for _ in range(2)]
    x = c.randn(*lead, 4, 4)
    grad = c.randn(*lead, *GRAD_SHAPE[name])
    fn = BACKWARDS[name]
    if "upsample" in name:  # only x's shape is an argument
        c.run(lambda g: fn(g, x), grad)
    else:
        c.run(fn, grad, x)


def test_partial_passes_through_linear_ops() -> None:
    mesh = reference_mesh({"x": 2})
    base = torch.randn(2, 3, 4, 4)
    x = monarch.distribute_tensor(base, mesh, {"x": P})
    for name in ("avg_pool2d", "bilinear", "reflect_pad2d", "adaptive_avg_pool2d"):
        out = POOLS[name](x)
        assert out.placements == (P,), name
        torch.testing.assert_close(out.full_tensor(timeout=30), POOLS[name](base), rtol=1e-4, atol=1e-5)
    out = F.max_pool2d(x, 2)
    assert out.placements != (P,)  # max is not linear: the input is reduced first
    torch.testing.assert_close(out.full_tensor(timeout=30), F.max_pool2d(base, 2))


# -- embedding_bag ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@examples(20)
def test_embedding_bag(mode: str, data: st.DataObject) -> None:
    c = Case(data)
    vocab, dim, bags = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    ids = torch.randint(0, vocab, (bags, 3), generator=c.gen)
    weighted = mode == "sum" and data.draw(st.booleans())
    psw = c.randn(bags, 3) if weighted else None
    c.run(lambda w, psw: F.embedding_bag(ids, w, mode=mode, per_sample_weights=psw), c.randn(vocab, dim), psw)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_feature_shard_trains_without_collectives(mode: str) -> None:
    """Weight sharded on features over 4 ranks (3 features: one rank has none): forward and the weight
    gradient stay feature-sharded and move nothing."""
    mesh = reference_mesh({"x": 4})
    torch.manual_seed(2)
    weight = torch.randn(7, 3, requires_grad=True)
    ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 6]), torch.tensor([0, 3, 5])
    w = monarch.distribute_tensor(weight.detach(), mesh, {"x": Shard(1)}).requires_grad_()
    out, shipped = comms(mesh, lambda: F.embedding_bag(ids, w, offsets, mode=mode))
    want = F.embedding_bag(ids, weight, offsets, mode=mode)
    assert shipped == [] and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(timeout=30), want)
    grad = torch.randn_like(want)
    want.backward(grad)
    _, shipped = comms(mesh, lambda: out.backward(monarch.distribute_tensor(grad, mesh, {"x": Shard(1)})))
    assert shipped == [] and w.grad.placements == (Shard(1),), shipped
    torch.testing.assert_close(w.grad.full_tensor(timeout=30), weight.grad)
