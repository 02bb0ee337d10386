"""Attention rules (graph/rules/nn.py) on the reference mesh: scaled_dot_product_attention forward
and backward against plain torch for random placements of batch, heads and query rows (uneven and empty
pieces), causal or masked (broadcast masks), grouped-query heads; collectives for batch and head sharding;
and nn.MultiheadAttention on a data-parallel module whose ranks hold one or no sample.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import monarch
from monarch import Partial, Replicate, Shard
from monarch.runtime.session.local import LocalMesh
from tests.strategies import reference_mesh, tensor_meshes

R, P = Replicate(), Partial("sum")
MESHES = ({"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})
pytestmark = pytest.mark.usefixtures("strict")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def run(mesh: Any, fn: Callable[..., torch.Tensor], plain: list[torch.Tensor | None],
        placements: list[Any], grads: int = 4) -> list[str]:
    """fn and the gradients of its first `grads` floating inputs on `mesh` equal plain torch (a mask that
    needs a gradient takes the math path); the forward's collectives."""
    want_in = [t.clone().requires_grad_(t.is_floating_point() and i < grads) if t is not None else None
               for i, t in enumerate(plain)]
    want = fn(*want_in)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    want.backward(grad)
    got_in = [monarch.distribute_tensor(t, mesh, list(p)).requires_grad_(w.requires_grad)
              if t is not None and w is not None else None for t, w, p in zip(plain, want_in, placements, strict=True)]
    s = mesh.session
    s.flush()
    before = len(s.collectives)
    out = fn(*got_in)
    s.flush()
    comms = s.collectives[before:]
    close(out.full_tensor(timeout=30), want.detach())
    out.backward(monarch.distribute_tensor(grad, mesh, list(out.placements)))
    for g, w in zip(got_in, want_in, strict=True):
        if w is not None and w.requires_grad:
            close(g.grad.full_tensor(timeout=30), w.grad)
    return comms


def sdpa(causal: bool, gqa: bool, scale: float | None) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    return fn


@st.composite
def attention_case(draw: st.DrawFn) -> dict[str, Any]:
    dims = draw(tensor_meshes(MESHES))
    b, hk, group = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2]))
    lq, ls, e = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.sampled_from([4, 8]))
    causal = draw(st.booleans())
    mask_shape = None if causal else draw(st.sampled_from(
        [None, (lq, ls), (b, 1, lq, ls), (1, hk * group, lq, ls), (b, hk * group, lq, ls), (1, ls)]))
    # per mesh dim, the dim of (B, H, L, E) that the queries shard on (None: replicated)
    where = draw(st.lists(st.sampled_from([None, 0, 1, 2]), min_size=len(dims), max_size=len(dims)))
    return dict(dims=dims, b=b, hk=hk, hq=hk * group, lq=lq, ls=ls, e=e, causal=causal, mask=mask_shape,
                bool_mask=draw(st.booleans()), where=where, seed=draw(st.integers(0, 2**16)),
                scale=draw(st.sampled_from([None, 0.3])))


@settings(deadline=None, max_examples=40)
@given(c=attention_case())
def test_sdpa_matches_torch(c: dict[str, Any]) -> None:
    """Queries sharded on a dim of (B, H, L, E) per mesh dim (nested shards too), keys and values by the
    same dim when it is batch or heads, else replicated; the mask replicated. Evenly sharded batch and
    heads move nothing."""
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["hq"], c["lq"], c["e"], generator=g)
    k = torch.randn(c["b"], c["hk"], c["ls"], c["e"], generator=g)
    v = torch.randn(c["b"], c["hk"], c["ls"], c["e"], generator=g)
    mask = None
    if c["mask"] is not None:
        mask = torch.randn(c["mask"], generator=g)
        mask = mask > -0.5 if c["bool_mask"] else mask
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # no fully masked row (torch gives NaN there)
    w = c["where"]
    qp = tuple(R if d is None else Shard(d) for d in w)
    kp = tuple(R if d in (None, 2) else Shard(d) for d in w)
    mesh = reference_mesh(c["dims"])
    comms = run(mesh, sdpa(c["causal"], c["hq"] != c["hk"], c["scale"]), [q, k, v, mask], [qp, kp, kp, (R,) * len(w)])
    sizes = mesh.extent.sizes
    pieces = {d: math.prod(n for n, e in zip(sizes, w, strict=True) if e == d) for d in (0, 1)}
    if 2 not in w and mask is None and c["b"] % pieces[0] == 0 and c["hk"] % pieces[1] == 0:
        assert comms == [], comms


@pytest.mark.parametrize("where", [0, 1])
def test_sdpa_batch_and_head_shards_stay(where: int) -> None:
    """Batch- or head-sharded attention moves nothing and its output stays sharded."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.randn(4, 1, 5, 5, generator=g)
    pl = (Shard(0), Shard(1)) if where == 0 else (Shard(1), Shard(0))
    mpl = (Shard(0), R) if where == 0 else (R, Shard(0))
    comms = run(mesh, sdpa(False, False, None), [q, k, v, mask], [pl, pl, pl, mpl], grads=3)
    assert comms == [], comms
    xs = [monarch.distribute_tensor(t, mesh, list(p)) for t, p in ((q, pl), (k, pl), (v, pl), (mask, mpl))]
    out = F.scaled_dot_product_attention(*xs[:3], attn_mask=xs[3])
    assert out.placements == pl


def test_gqa_heads_stay_sharded() -> None:
    mesh = reference_mesh({"x": 2})
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 5, 4, generator=g)
    k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(2))
    comms = run(mesh, sdpa(True, True, None), [q, k, v, None], [(Shard(1),)] * 3 + [(R,)])
    assert comms == [], comms


def test_query_rows_give_partial_key_grads() -> None:
    """Rows sharded, keys replicated: the forward moves nothing, grad_k and grad_v are Partial."""
    mesh = reference_mesh({"x": 2})
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, requires_grad=True) for _ in range(3))
    xs = [monarch.distribute_tensor(q.detach(), mesh, [Shard(2)]).requires_grad_()] + \
        [monarch.distribute_tensor(t.detach(), mesh, [R]).requires_grad_() for t in (k, v)]
    out = F.scaled_dot_product_attention(*xs)
    assert out.placements == (Shard(2),)
    out.sum().backward()
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    for got, want in zip(xs, (q, k, v), strict=True):
        close(got.grad.full_tensor(timeout=30), want.grad)


def test_sdpa_3d_math_path() -> None:
    """3-d inputs take the math path (bmm, _safe_softmax): sharded on the batch, values match."""
    mesh = reference_mesh({"x": 2})
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 5, 8, generator=g) for _ in range(3))
    comms = run(mesh, sdpa(False, False, None), [q, k, v, None], [(Shard(0),)] * 3 + [(R,)])
    assert comms == [], comms


# -- nn.MultiheadAttention on a data-parallel module ------------------------------------------------
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dims, batch", [({"dp": 2}, 1), ({"dp": 4}, 2), ({"dp": 4}, 3), ({"dp": 2}, 4)])
def test_mha_data_parallel_small_batches(need_weights: bool, dims: dict, batch: int) -> None:
    """Ranks holding one sample or none: the attention output of flash attention is laid out like its
    query, so a piece's layout differs from the global one and a view torch allows globally may not
    exist on the piece."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    model = copy.deepcopy(ref)
    monarch.data_parallel(model, LocalMesh(dims))
    q = torch.randn(batch, 3, 32)
    out = model(q, q, q, need_weights=need_weights)[0]
    out.sum().backward()
    want = ref(q, q, q, need_weights=need_weights)[0]
    want.sum().backward()
    close(out.full_tensor(timeout=30), want.detach())
    for (name, p), w in zip(model.named_parameters(), ref.parameters(), strict=True):
        close(p.grad.full_tensor(timeout=30), w.grad)


def test_partial_values_and_grad_pass_through() -> None:
    """The forward is linear in v: a Partial v gives a Partial output and moves nothing; the backward
    (linear in grad_out, but reading the forward's output) matches torch."""
    mesh = reference_mesh({"x": 2})
    g = torch.Generator().manual_seed(4)
    q, k, v, grad = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(4))
    xs = [monarch.distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in ((q, R), (k, R), (v, P))]
    s = mesh.session
    s.flush()
    before = len(s.collectives)
    out = F.scaled_dot_product_attention(*xs, is_causal=True)
    s.flush()
    assert out.placements == (P,) and s.collectives[before:] == [], s.collectives[before:]
    out.backward(monarch.distribute_tensor(grad, mesh, [P]))
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    w = F.scaled_dot_product_attention(*want, is_causal=True)
    w.backward(grad)
    close(out.full_tensor(timeout=30), w.detach())
    for got, t in zip(xs, want, strict=True):
        close(got.grad.full_tensor(timeout=30), t.grad)


class _SelfAttention(nn.Module):
    """nn.MultiheadAttention over (batch, seq, embed) inputs, batch first or not, with its weights added."""

    def __init__(self, batch_first: bool, need_weights: bool) -> None:
        super().__init__()
        self.batch_first, self.need_weights = batch_first, need_weights
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.batch_first else x.transpose(0, 1)
        out, weights = self.attn(h, h, h, need_weights=self.need_weights)
        out = out if self.batch_first else out.transpose(0, 1)
        return out if weights is None else out + weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batch", [4, 3])
def test_mha_data_parallel_moves_no_activations(batch_first: bool, need_weights: bool, batch: int) -> None:
    """A data-parallel MultiheadAttention step (batch sharded, evenly or not, weights replicated) runs
    no collective but the all_reduce of each weight gradient; values and gradients equal torch's."""
    torch.manual_seed(0)
    ref = _SelfAttention(batch_first, need_weights)
    model = copy.deepcopy(ref)
    mesh = reference_mesh({"dp": 2})
    monarch.data_parallel(model, mesh)
    x = torch.randn(batch, 3, 16, generator=torch.Generator().manual_seed(1))
    s = mesh.session
    s.flush()
    before = len(s.collectives)
    out = model(x)
    out.pow(2).mean().backward()
    grads = [p.grad.redistribute([R]) for p in model.parameters()]
    s.flush()
    kinds = [str(c).split("[")[0] for c in s.collectives[before:]]
    assert set(kinds) == {"all_reduce"} and len(kinds) <= len(grads), kinds
    want = ref(x)
    want.pow(2).mean().backward()
    close(out.full_tensor(timeout=30), want.detach())
    for g, p in zip(grads, ref.parameters(), strict=True):
        close(g.full_tensor(timeout=30), p.grad)
