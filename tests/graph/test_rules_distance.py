"""Distance and CTC rules (graph/rules/signal.py): cdist forward and backward with broadcast batch dims
and pdist against plain torch on the reference mesh for random shapes and placements, with no data moved
when x1's rows are sharded and x2 is replicated; the CTC loss and its gradient with padded and concatenated
targets, every reduction, and ranks holding no sample; CTC on a real mesh.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import monarch
from monarch import Partial, Replicate, Shard
from monarch.actor import ProcMesh
from tests.graph.rule_cases import Case, check, examples, run
from tests.strategies import reference_mesh, tensor_shapes

R, P = Replicate(), Partial("sum")
pytestmark = pytest.mark.usefixtures("strict")


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.0, float("inf")])
@examples(15)
def test_cdist_with_its_gradients(p: float, data: st.DataObject) -> None:
    """x1 (*batch1, P, M), x2 (*batch2, R, M) with broadcasting batches; gradients of both (p > 0)."""
    c = Case(data)
    batch = data.draw(tensor_shapes(0, 2, 1, 3))
    other = tuple(1 if data.draw(st.booleans()) else n for n in batch)
    rows, cols, m = (data.draw(st.integers(1, 6)) for _ in range(3))
    x1, x2 = c.randn(*batch, rows, m), c.randn(*other, cols, m)
    if p == 0.0:
        c.run(lambda a, b: torch.cdist(a, b, p=p), x1, x2)
        return

    def both(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = torch.cdist(a, b, p=p)
        grads = torch.autograd.grad((out * torch.arange(out.shape[-1], dtype=out.dtype)).sum(), (a, b))
        return (out.detach(), *grads)
    c.run(both, x1, x2)


def test_cdist_rows_stay_sharded() -> None:
    """x1's rows sharded and x2 replicated: the result is row-sharded and nothing moves; x2's rows
    sharded instead shard the result's columns."""
    mesh = reference_mesh({"x": 4})
    x1, x2 = torch.randn(2, 7, 3), torch.randn(2, 5, 3)
    a = monarch.distribute_tensor(x1, mesh, {"x": Shard(1)})
    b = monarch.distribute_tensor(x2, mesh, {"x": R})
    got, comms = run(mesh, lambda t: torch.cdist(t, b), a)
    check(got, torch.cdist(x1, x2))
    assert comms == [], comms
    assert torch.cdist(a, b).placements == (Shard(1),)
    cols = torch.cdist(monarch.distribute_tensor(x1, mesh, {"x": R}),
                       monarch.distribute_tensor(x2, mesh, {"x": Shard(1)}))
    assert cols.placements == (Shard(2),)
    features = torch.cdist(monarch.distribute_tensor(x1, mesh, {"x": Shard(2)}),
                           monarch.distribute_tensor(x2, mesh, {"x": Shard(2)}), p=1.0)
    assert features.placements == (P,)
    torch.testing.assert_close(features.full_tensor(timeout=30), torch.cdist(x1, x2, p=1.0), rtol=1e-5, atol=1e-5)


@examples(10)
def test_pdist(data: st.DataObject) -> None:
    c = Case(data)
    p = data.draw(st.sampled_from([1.0, 2.0]))
    c.run(lambda x: F.pdist(x, p=p), c.randn(data.draw(st.integers(2, 6)), data.draw(st.integers(1, 4))))


def _ctc_case(gen: torch.Generator, n: int, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    t, c, s = 7, 5, 4
    log_probs = torch.randn(t, n, c, generator=gen).log_softmax(2)
    targets = torch.randint(1, c, (n, s), generator=gen)
    inputs = [int(v) for v in torch.randint(s + 1, t + 1, (n,), generator=gen)]
    lengths = [int(v) for v in torch.randint(1, s + 1, (n,), generator=gen)]
    if concatenated:
        targets = torch.cat([targets[i, :lengths[i]] for i in range(n)])
    return log_probs, targets, inputs, lengths


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@examples(12)
def test_ctc_loss_and_gradient(reduction: str, data: st.DataObject) -> None:
    """Samples over the ranks (some holding none), each its own loss and gradient; the lengths as lists or
    as (distributed) tensors."""
    c = Case(data)
    log_probs, targets, inputs, lengths = _ctc_case(c.gen, data.draw(st.integers(1, 5)), data.draw(st.booleans()))
    as_tensors = data.draw(st.booleans())

    def loss_and_grad(x: torch.Tensor, tg: torch.Tensor, *given: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        loss = F.ctc_loss(x, tg, *(given or (inputs, lengths)), reduction=reduction)
        weights = torch.arange(1, loss.numel() + 1, dtype=loss.dtype).reshape(loss.shape)
        return loss.detach(), torch.autograd.grad((loss * weights).sum(), x)[0]
    tensors = (torch.tensor(inputs), torch.tensor(lengths)) if as_tensors else ()
    c.run(loss_and_grad, log_probs, targets, *tensors)


def test_ctc_batch_stays_sharded_with_empty_ranks() -> None:
    """3 samples over 4 ranks: the loss keeps the batch shard, log_alpha its global width."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    log_probs, targets, inputs, lengths = _ctc_case(torch.Generator().manual_seed(1), 3, False)
    x = monarch.distribute_tensor(log_probs, mesh, {"dp": Shard(1), "tp": Shard(1)})
    tg = monarch.distribute_tensor(targets, mesh, {"dp": Shard(0), "tp": Shard(0)})
    nll, alpha = torch.ops.aten._ctc_loss(x, tg, inputs, lengths)
    want = torch.ops.aten._ctc_loss(log_probs, targets, inputs, lengths)
    assert nll.placements == alpha.placements == (Shard(0), Shard(0))
    assert alpha.shape == want[1].shape
    torch.testing.assert_close(nll.full_tensor(timeout=30), want[0])


def test_ctc_on_a_real_mesh(procs: ProcMesh) -> None:
    log_probs, targets, inputs, lengths = _ctc_case(torch.Generator().manual_seed(2), 3, True)
    x = monarch.distribute_tensor(log_probs, procs, {"dp": Shard(1), "tp": R}).requires_grad_()
    loss = F.ctc_loss(x, monarch.distribute_tensor(targets, procs), inputs, lengths, reduction="none")
    assert loss.placements == (Shard(0), R)
    loss.sum().backward()
    plain = log_probs.clone().requires_grad_()
    want = F.ctc_loss(plain, targets, inputs, lengths, reduction="none")
    want.sum().backward()
    torch.testing.assert_close(loss.full_tensor(timeout=60), want)
    torch.testing.assert_close(x.grad.full_tensor(timeout=60), plain.grad)
