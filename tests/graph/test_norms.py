"""Norms with global statistics on a real dp=2 x tp=2 mesh, against plain torch on the whole batch: batch norm
(training with running stats, eval, backward), group, layer and RMS norm, vector_norm and clip_grad_norm_
over sharded gradients. The collectives are asserted: C-sized all_reduces, never a gather of activations.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import monarch
from monarch import Replicate, Shard
from monarch.runtime.session.session import session_of
from monarch.tensor.meshtensor import MeshTensor

pytestmark = [pytest.mark.usefixtures("strict"), pytest.mark.timeout(120)]
R = Replicate()
TIMEOUT = 30.0


def collectives(mesh: Any, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """fn's result and the collectives its tensor work ships (everything pending is shipped first)."""
    s = session_of(mesh)
    s.flush()
    n = len(s.collectives)
    out = fn()
    s.flush()
    return out, s.collectives[n:]


def close(got: Any, want: torch.Tensor, tol: float = 1e-5) -> None:
    got = got.full_tensor(timeout=TIMEOUT) if isinstance(got, MeshTensor) else got
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def put(t: torch.Tensor, mesh: Any, *placements: Any) -> MeshTensor:
    return monarch.distribute_tensor(t.clone(), mesh, list(placements) or [R, R])


@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm_training_updates_running_stats(procs: Any, affine: bool) -> None:
    """Over a dp-sharded batch (tp shards a spatial dim): the two statistics are all_reduced, nothing else."""
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 6, 5) * 3 + 1, torch.randn(6), torch.randn(6)
    mean, var = torch.randn(6), torch.rand(6) + 0.5
    args = (w, b) if affine else (None, None)
    want_mean, want_var = mean.clone(), var.clone()
    want = F.batch_norm(x, want_mean, want_var, *args, training=True, momentum=0.2)
    dm, dv = put(mean, procs), put(var, procs)
    dargs = tuple(put(t, procs) if t is not None else None for t in args)
    dx = put(x, procs, Shard(0), Shard(2))
    got, comms = collectives(procs, lambda: F.batch_norm(dx, dm, dv, *dargs, training=True, momentum=0.2))
    assert sorted(comms) == ["all_reduce[dp]"] * 2 + ["all_reduce[tp]"] * 2  # mean and var, over both mesh dims
    assert got.placements == (Shard(0), Shard(2))
    close(got, want)
    close(dm, want_mean)
    close(dv, want_var)


def test_batch_norm_eval_is_local(procs: Any) -> None:
    torch.manual_seed(1)
    x, mean, var, w = torch.randn(8, 6, 3), torch.randn(6), torch.rand(6) + 0.5, torch.randn(6)
    want = F.batch_norm(x, mean, var, w, training=False)
    dx = put(x, procs, Shard(0), Shard(1))
    got, comms = collectives(procs, lambda: F.batch_norm(dx, put(mean, procs), put(var, procs), put(w, procs)))
    assert comms == [] and got.placements == (Shard(0), Shard(1))
    close(got, want)


def test_batch_norm_backward(procs: Any) -> None:
    """Input grads need the two batch sums of the gradient (all_reduced); parameter grads stay Partial."""
    torch.manual_seed(2)
    x, w, b, g = torch.randn(8, 4, 6), torch.randn(4), torch.randn(4), torch.randn(8, 4, 6)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    F.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True).backward(g)
    dx = put(x, procs, Shard(0), R).requires_grad_()
    dw, db = put(w, procs).requires_grad_(), put(b, procs).requires_grad_()
    y = F.batch_norm(dx, None, None, dw, db, training=True)
    _, comms = collectives(procs, lambda: y.backward(put(g, procs, Shard(0), R)))
    assert comms == ["all_reduce[dp]"] * 2, comms
    for got, leaf in zip((dx, dw, db), leaves, strict=True):
        close(got.grad, leaf.grad, 1e-4)
    assert dw.grad.placements[0].is_partial() and dx.grad.placements == (Shard(0), R)


def test_batch_norm_module_trains_like_torch(procs: Any) -> None:
    """nn.BatchNorm1d on a dp-sharded batch: outputs, running stats and num_batches_tracked over 3 steps."""
    torch.manual_seed(3)
    ref = torch.nn.BatchNorm1d(5)
    dist = torch.nn.BatchNorm1d(5)
    for name, t in ref.named_buffers():
        dist._buffers[name] = put(t, procs)
    for _ in range(3):
        x = torch.randn(8, 5)
        close(dist(put(x, procs, Shard(0), R)), ref(x))
    for name, t in ref.named_buffers():
        close(dist._buffers[name], t)


def test_group_rms_layer_norm_stay_sharded(procs: Any) -> None:
    """Per-sample statistics: a batch shard needs no collective at all, forward or backward (the weight
    grads stay Partial until read)."""
    torch.manual_seed(4)
    x, w, g = torch.randn(8, 6, 5), torch.randn(6, 5), torch.randn(8, 6, 5)
    cases: list[Callable[[Any, Any], Any]] = [lambda t, w: F.group_norm(t, 3, w[:, 0], w[:, 1]),
                                              lambda t, w: F.rms_norm(t, (5,), w[0]),
                                              lambda t, w: F.layer_norm(t, (6, 5), w)]
    for fn in cases:
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        fn(*leaves).backward(g)
        dx, dw = put(x, procs, Shard(0), R).requires_grad_(), put(w, procs).requires_grad_()
        got, comms = collectives(procs, lambda: fn(dx, dw))
        assert comms == [] and got.placements == (Shard(0), R)
        close(got, fn(x, w))
        _, comms = collectives(procs, lambda: got.backward(put(g, procs, Shard(0), R)))
        assert comms == [] and dx.grad.placements == (Shard(0), R) and dw.grad.placements[0].is_partial()
        close(dx.grad, leaves[0].grad, 1e-4)
        close(dw.grad, leaves[1].grad, 1e-4)


@pytest.mark.parametrize("p", [2.0, 1.0, float("inf")])
def test_vector_norm_of_a_sharded_tensor(procs: Any, p: float) -> None:
    x = torch.randn(8, 6)
    dx = put(x, procs, Shard(0), Shard(1))
    got, comms = collectives(procs, lambda: torch.linalg.vector_norm(dx, p).full_tensor(timeout=TIMEOUT))
    assert sorted(comms) == ["all_reduce[dp]", "all_reduce[tp]"]  # the inf norm stays Partial(max) until read
    close(got, torch.linalg.vector_norm(x, p))


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("p", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_over_sharded_grads(procs: Any, p: float, foreach: bool) -> None:
    """Local norms, then all_reduces of scalars; never a gather."""
    torch.manual_seed(5)
    grads = [torch.randn(8, 6), torch.randn(6)]
    layouts = [(Shard(0), Shard(1)), (Shard(0), R)]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    dist = [torch.nn.Parameter(put(torch.zeros_like(g), procs)) for g in grads]
    for r, d, g, lay in zip(ref, dist, grads, layouts, strict=True):
        r.grad, d.grad = g.clone(), put(g, procs, *lay)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=p, foreach=foreach)
    total, comms = collectives(procs, lambda: torch.nn.utils.clip_grad_norm_(dist, 0.5, norm_type=p, foreach=foreach))
    if foreach:  # one _foreach_norm: all the local norms stacked, one all_reduce per mesh dim
        assert sorted(comms) == ["all_reduce[dp]", "all_reduce[tp]"], comms
    else:  # one vector_norm per gradient, each all_reduced over the mesh dims it is sharded on
        assert sorted(comms) == ["all_reduce[dp]"] * 2 + ["all_reduce[tp]"] * (1 + (p == float("inf"))), comms
    close(total, want)
    for r, d in zip(ref, dist, strict=True):
        close(d.grad, r.grad)


def test_batch_norm_with_empty_pieces(procs: Any) -> None:
    """3 samples over dp=2 and a spatial dim of 1 over tp=2: some ranks hold nothing, none hangs, values hold."""
    torch.manual_seed(6)
    x, g, w = torch.randn(3, 2, 1), torch.randn(3, 2, 1), torch.randn(2)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    mean, var = torch.zeros(2), torch.ones(2)
    F.batch_norm(leaves[0], mean, var, leaves[1], training=True).backward(g)
    dx, dw = put(x, procs, Shard(0), Shard(2)).requires_grad_(), put(w, procs).requires_grad_()
    dm, dv = put(torch.zeros(2), procs), put(torch.ones(2), procs)
    F.batch_norm(dx, dm, dv, dw, training=True).backward(put(g, procs, Shard(0), Shard(2)))
    for got, want in ((dx.grad, leaves[0].grad), (dw.grad, leaves[1].grad), (dm, mean), (dv, var)):
        close(got, want, 1e-4)
