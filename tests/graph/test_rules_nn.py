"""Neural-network op rules (graph/rules/nn.py) on the reference mesh: softmax, layer norm, embedding and
nll_loss with their backward ops against plain torch for random shapes (uneven and empty shards) and
placements; collectives for the key cases; the rules themselves on hand-built specs.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.graph.propagate import decide
from monarch.graph.rules.table import RULES, Emit, OpCall, Strategy
from monarch.program.instr import Buf, Local
from monarch.shape import Extent
from monarch.tensor.spec import Spec
from tests.graph.rule_cases import Case, examples
from tests.strategies import reference_mesh, tensor_shapes

aten = torch.ops.aten
R, P = Replicate(), Partial("sum")
IGNORE = -100
pytestmark = pytest.mark.usefixtures("strict")


def sharded(case: Case, i: int, dims: set[int]) -> bool:
    """Whether input i is sharded on any of `dims`."""
    return any(isinstance(p, Shard) and p.dim in dims for p in case.placed[i])


# -- softmax ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("log", [False, True])
@examples()
def test_softmax(log: bool, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 7))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    fn = torch.log_softmax if log else torch.softmax
    _, comms = c.run(lambda x: fn(x, dim), c.randn(*shape))
    if c.plain_placements() and not sharded(c, 0, {dim % len(shape)}):
        assert comms == [], comms


@pytest.mark.parametrize("op", [aten._softmax_backward_data.default, aten._log_softmax_backward_data.default])
@examples()
def test_softmax_backward(op: Any, data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 7))
    dim = data.draw(st.integers(0, len(shape) - 1))
    x = c.randn(*shape)
    y = torch.log_softmax(x, dim) if op is aten._log_softmax_backward_data.default else torch.softmax(x, dim)
    c.run(lambda g, out: op(g, out, dim, torch.float32), c.randn(*shape), y)


# -- layer norm -------------------------------------------------------------------------------------
@examples()
def test_layer_norm(data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 7))
    k = data.draw(st.integers(1, len(shape)))
    norm = list(shape[len(shape) - k:])
    affine = data.draw(st.booleans())
    w, b = (c.randn(*norm), c.randn(*norm)) if affine else (None, None)
    _, comms = c.run(lambda x, w, b: aten.native_layer_norm(x, norm, w, b, 1e-5), c.randn(*shape), w, b)
    if c.plain_placements() and not any(isinstance(p, Shard) for ps in c.placed[1:] for p in ps):
        if not sharded(c, 0, set(range(len(shape) - k, len(shape)))):
            assert comms == [], comms


@examples()
def test_layer_norm_backward(data: st.DataObject) -> None:
    c = Case(data)
    shape = data.draw(tensor_shapes(1, 3, 1, 7))
    norm = list(shape[len(shape) - data.draw(st.integers(1, len(shape))):])
    affine = data.draw(st.booleans())
    w, b = (c.randn(*norm), c.randn(*norm)) if affine else (None, None)
    params = [affine and data.draw(st.booleans()), affine and data.draw(st.booleans())]
    mask = [data.draw(st.booleans()) or not any(params), *params]
    x = c.randn(*shape)
    _, mean, rstd = aten.native_layer_norm(x, norm, w, b, 1e-5)
    c.run(lambda g, x, mean, rstd, w, b: aten.native_layer_norm_backward(g, x, norm, mean, rstd, w, b, mask),
          c.randn(*shape), x, mean, rstd, w, b)


# -- embedding --------------------------------------------------------------------------------------
@examples(50)
def test_embedding(data: st.DataObject) -> None:
    c = Case(data)
    vocab, hidden = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 5))
    ids = torch.randint(0, vocab, data.draw(tensor_shapes(1, 2, 1, 7)), generator=c.gen)
    _, comms = c.run(F.embedding, ids, c.randn(vocab, hidden))
    if c.plain_placements() and all(p == R for p in c.placed[0]):
        vocab_dims = sorted(name for name, p in zip(c.dims, c.placed[1], strict=True)
                            if p == Shard(0) and c.dims[name] > 1)  # (one rank: nothing to reduce over)
        assert sorted(comms) == [f"all_reduce[{n}]" for n in vocab_dims], comms


@examples()
def test_embedding_backward(data: st.DataObject) -> None:
    c = Case(data)
    vocab, hidden = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 5))
    shape = data.draw(tensor_shapes(1, 2, 1, 7))
    ids = torch.randint(0, vocab, shape, generator=c.gen)
    pad, freq = data.draw(st.integers(-1, vocab - 1)), data.draw(st.booleans())
    c.run(lambda g, i: aten.embedding_dense_backward(g, i, vocab, pad, freq), c.randn(*shape, hidden), ids)


# -- nll_loss ---------------------------------------------------------------------------------------
NLL = {2: (aten.nll_loss_forward.default, aten.nll_loss_backward.default),
       4: (aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default)}


def loss_inputs(c: Case, data: st.DataObject) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """log-probabilities (C,), (N, C) or (N, C, H, W); targets with some ignored; optional class weights;
    a reduction."""
    sizes = [data.draw(st.integers(1, 5)) for _ in range(4)]
    shape = tuple(sizes[1:2] if (ndim := data.draw(st.sampled_from([1, 2, 2, 4]))) == 1 else sizes[:ndim])
    logp = torch.log_softmax(c.randn(*shape), 0 if ndim == 1 else 1)
    target = torch.randint(0, sizes[1], shape[:1] + shape[2:] if ndim > 1 else (), generator=c.gen)
    target = torch.where(torch.rand(target.shape, generator=c.gen) < 0.2, IGNORE, target)
    weight = torch.rand(sizes[1], generator=c.gen) + 0.1 if data.draw(st.booleans()) else None
    return logp, target, weight, data.draw(st.integers(0, 2))


@examples(50)
def test_nll_loss(data: st.DataObject) -> None:
    c = Case(data)
    logp, target, weight, reduction = loss_inputs(c, data)
    op = NLL[max(logp.ndim, 2)][0]
    c.run(lambda x, t, w: op(x, t, w, reduction, IGNORE), logp, target, weight)


@examples(50)
def test_nll_loss_backward(data: st.DataObject) -> None:
    c = Case(data)
    logp, target, weight, reduction = loss_inputs(c, data)
    forward, op = NLL[max(logp.ndim, 2)]
    total = forward(logp, target, weight, reduction, IGNORE)[1]
    grad = c.randn(*target.shape) if reduction == 0 else torch.tensor(1.5)
    c.run(lambda g, x, t, w, tw: op(g, x, t, w, reduction, IGNORE, tw), grad, logp, target, weight, total)


# -- collectives of the key cases -------------------------------------------------------------------
def test_softmax_over_unsharded_dim_moves_nothing() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    base = torch.randn(5, 3, 6)
    x = monarch.distribute_tensor(base, mesh, {"dp": Shard(0), "tp": Shard(1)})
    before = len(mesh.session.collectives)
    y = torch.softmax(x, -1)
    assert y.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(y.full_tensor(), torch.softmax(base, -1))
    assert mesh.session.collectives[before:] == []


def test_cross_entropy_batch_sharded_forward_and_backward() -> None:
    mesh = reference_mesh({"x": 4})
    logits, target = torch.randn(7, 5, requires_grad=True), torch.tensor([0, 4, IGNORE, 1, 1, 3, 2])
    x = monarch.distribute_tensor(logits, mesh, {"x": Shard(0)})
    t = monarch.distribute_tensor(target, mesh, {"x": Shard(0)})
    before = len(mesh.session.collectives)
    loss = F.cross_entropy(x, t)
    assert loss.placements == (P,)
    want = F.cross_entropy(logits, target)
    torch.testing.assert_close(loss.full_tensor(), want)
    assert mesh.session.collectives[before:] == ["all_gather[x]", "all_reduce[x]"]  # targets; the loss
    loss.backward()
    want.backward()
    assert x.grad.placements == (Shard(0),)
    torch.testing.assert_close(x.grad.full_tensor(), logits.grad)


def test_layer_norm_grads_of_parameters_are_partial() -> None:
    mesh = reference_mesh({"x": 2})
    base, w, b = torch.randn(3, 4, 6), torch.randn(6), torch.randn(6)
    x = monarch.distribute_tensor(base, mesh, {"x": Shard(1)})
    ws = [monarch.distribute_tensor(t, mesh) for t in (w, b)]
    _, mean, rstd = aten.native_layer_norm(x, [6], *ws, 1e-5)
    g = monarch.distribute_tensor(torch.randn(3, 4, 6), mesh, {"x": Shard(1)})
    grads = aten.native_layer_norm_backward(g, x, [6], mean, rstd, *ws, [True, True, True])
    assert [t.placements for t in grads] == [(Shard(1),), (P,), (P,)]
    _, m0, r0 = aten.native_layer_norm(base, [6], w, b, 1e-5)
    want = aten.native_layer_norm_backward(g.full_tensor(), base, [6], m0, r0, w, b, [True, True, True])
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got.full_tensor(), ref, rtol=1e-4, atol=1e-5)


def test_vocab_sharded_embedding_is_one_all_reduce() -> None:
    mesh = reference_mesh({"x": 4})
    weight, ids = torch.randn(6, 3), torch.tensor([[0, 5, 2], [3, 3, 1]])  # rows 2, 2, 2, 0 per rank
    w = monarch.distribute_tensor(weight, mesh, {"x": Shard(0)})
    i = monarch.distribute_tensor(ids, mesh)
    before = len(mesh.session.collectives)
    out = F.embedding(i, w)
    assert out.placements == (P,)
    torch.testing.assert_close(out.full_tensor(), F.embedding(ids, weight))
    assert mesh.session.collectives[before:] == ["all_reduce[x]"]


# -- the rules on hand-built specs ------------------------------------------------------------------
MESH = Extent(("x",), (4,))


def spec(shape: tuple[int, ...], *placements: Any, dtype: torch.dtype = torch.float32) -> Spec:
    stride = tuple(torch.empty(shape, device="meta").stride())
    return Spec(shape, stride, dtype, tuple(placements) or (R,), MESH)


def emit_at(call: OpCall, coords: tuple[int, ...], args: tuple, outs: tuple[int, ...]) -> list[Local]:
    """The instructions the decided emitter gives the rank at `coords`."""
    d = decide(call)
    assert d.emit is not None
    temps = iter(range(-1, -100, -1))
    return d.emit(Emit(call, d.ins, d.outs, coords, args, {}, outs, lambda: next(temps)))


def test_rule_softmax_never_shards_its_dim() -> None:
    x = spec((4, 6, 5), Shard(2))
    call = OpCall(aten._softmax.default, (x, 2, False), {}, (x,), (spec((4, 6, 5)),))
    want = [Strategy((Shard(0),), (Shard(0),)), Strategy((Shard(1),), (Shard(1),))]
    assert RULES[aten._softmax.default](call, 0) == want


def test_rule_nll_mean_replicates_targets_and_divides_by_the_global_weight() -> None:
    x, t = spec((7, 5), Shard(0)), spec((7,), Shard(0), dtype=torch.int64)
    call = OpCall(aten.nll_loss_forward.default, (x, t, None, 1, IGNORE), {}, (x, t), (spec(()), spec(())))
    d = decide(call)
    assert [s.placements for s in d.ins] == [(Shard(0),), (R,)]
    assert [s.placements for s in d.outs] == [(P,), (R,)]
    ops = [i.op for i in emit_at(call, (3,), (Buf(1), Buf(2), None, 1, IGNORE), (3, 4))]
    assert ops == ["aten::slice.Tensor", "aten::nll_loss_forward", "aten::ne.Scalar", "aten::sum.default",
                   "aten::div.Tensor"]


def test_rule_vocab_embedding_masks_and_covers_empty_pieces() -> None:
    w, ids = spec((3, 4), Shard(0)), spec((2, 5), dtype=torch.int64)  # rows 1, 1, 1, 0 per rank
    call = OpCall(aten.embedding.default, (w, ids), {}, (w, ids), (spec((2, 5, 4)),))
    assert Strategy((Shard(0), R), (P,)) in RULES[aten.embedding.default](call, 0)
    assert decide(call).outs[0].placements == (P,)
    instrs = emit_at(call, (3,), (Buf(1), Buf(2)), (3,))
    assert [i.op for i in instrs][-3:] == ["aten::new_zeros", "aten::embedding", "aten::masked_fill.Scalar"]
    assert instrs[0].args == (Buf(2), 3) and instrs[-2].args[0] == Buf(instrs[-3].outs[0])
