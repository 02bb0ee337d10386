"""In-place random fills and the nn.init functions built on them, in strict mode: after the same
monarch.manual_seed every placement and mesh shape gives the same global tensor (uneven and empty
pieces included; orthogonal_ and sparse_ too), the draws follow their laws, dirac_ and eye_ give
torch's values on sharded dims, and a model built under `procs.activate()` on a real mesh is
initialised there (no fallback) with the values the reference mesh gives, and trains.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import init

import monarch
from monarch import Partial, Replicate, Shard
from monarch.actor import ProcMesh
from monarch.errors import UnsupportedOpError
from tests.strategies import placement_tuples, reference_mesh, tensor_meshes

T = 30.0  # seconds any single wait may take
R = Replicate()
MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})
pytestmark = pytest.mark.usefixtures("strict")

FILLS: dict[str, tuple[Callable[[Any], Any], torch.dtype]] = {
    "uniform_": (lambda x: x.uniform_(-2.0, 3.0), torch.float32),
    "normal_": (lambda x: x.normal_(1.0, 0.5), torch.float32),
    "bernoulli_": (lambda x: x.bernoulli_(0.3), torch.float32),
    "bernoulli_ tensor p": (lambda x: x.bernoulli_(torch.linspace(0, 1, x.shape[-1])), torch.float32),
    "exponential_": (lambda x: x.exponential_(2.0), torch.float32),
    "geometric_": (lambda x: x.geometric_(0.3), torch.float32),
    "log_normal_": (lambda x: x.log_normal_(0.5, 0.25), torch.float64),
    "cauchy_": (lambda x: x.cauchy_(1.0, 2.0), torch.float32),
    "random_": (lambda x: x.random_(), torch.float32),
    "random_ int64": (lambda x: x.random_(), torch.int64),
    "random_ to": (lambda x: x.random_(7), torch.int32),
    "random_ from to": (lambda x: x.random_(-3, 4), torch.int64),
    "random_ bool": (lambda x: x.random_(), torch.bool),
    "kaiming_uniform_": (lambda x: init.kaiming_uniform_(x, a=math.sqrt(5)), torch.float32),
    "kaiming_normal_": (init.kaiming_normal_, torch.float32),
    "xavier_normal_": (init.xavier_normal_, torch.float32),
    "xavier_uniform_": (init.xavier_uniform_, torch.float32),
    "trunc_normal_": (lambda x: init.trunc_normal_(x, 0.0, 1.0, -1.5, 2.0), torch.float32),
    "sparse_": (lambda x: _sparse(x), torch.float32),
}


def _sparse(x: torch.Tensor) -> torch.Tensor:
    """init.sparse_ picks each column's zero rows with torch.randperm, from torch's own generator."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return init.sparse_(x, 0.5)


def filled(name: str, mesh: Any, placements: tuple, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The global tensor `FILLS[name]` leaves in zeros of `shape` placed as `placements`."""
    fn, dtype = FILLS[name]
    monarch.manual_seed(seed)
    x = monarch.distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)
    fn(x)
    return x.full_tensor(timeout=T)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_same_seed_same_values_on_every_placement_and_mesh(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(FILLS)))
    shape = (data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6)))  # 1..3 rows on 4 ranks: empty pieces
    seed = data.draw(st.integers(0, 2**31))
    dims = data.draw(tensor_meshes(MESHES))
    partial = FILLS[name][1].is_floating_point
    placements = data.draw(placement_tuples(len(shape), len(dims), partial=partial))
    want = filled(name, reference_mesh({"x": 1}), (monarch.Replicate(),), shape, seed)
    got = filled(name, reference_mesh(dims), placements, shape, seed)
    assert torch.equal(got, want), (name, dims, placements)
    assert not torch.equal(filled(name, reference_mesh(dims), placements, (64, 64), seed + 1),
                           filled(name, reference_mesh(dims), placements, (64, 64), seed + 2)), "seeds must differ"


def test_draws_follow_their_laws() -> None:
    mesh = reference_mesh({"dp": 2, "tp": 2})
    split = (monarch.Shard(0), monarch.Shard(1))

    def draw(name: str) -> torch.Tensor:
        return filled(name, mesh, split, (100, 100), 11).double()
    u = draw("uniform_")
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.05
    n = draw("normal_")
    assert abs(n.mean() - 1) < 0.02 and abs(n.std() - 0.5) < 0.02
    assert abs(draw("bernoulli_").mean() - 0.3) < 0.02
    p = draw("bernoulli_ tensor p")
    assert (p[:, 0] == 0).all() and (p[:, -1] == 1).all() and abs(p.mean() - 0.5) < 0.02
    e = draw("exponential_")
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 0.02
    g = draw("geometric_")
    assert g.min() >= 1 and torch.equal(g, g.round()) and abs(g.mean() - 1 / 0.3) < 0.1
    assert abs(draw("log_normal_").log().mean() - 0.5) < 0.01
    assert abs(draw("cauchy_").median() - 1.0) < 0.1
    r = draw("random_")
    assert r.min() >= 0 and r.max() <= 2**24 and torch.equal(r, r.round()) and r.max() > 2**23
    assert set(draw("random_ to").unique().tolist()) == set(range(7))
    assert set(draw("random_ from to").unique().tolist()) == set(range(-3, 4))
    assert set(draw("random_ bool").unique().tolist()) == {0, 1}
    assert draw("random_ int64").min() >= 0
    t = draw("trunc_normal_")
    assert t.min() >= -1.5 and t.max() <= 2.0
    bound = 1 / math.sqrt(100)  # kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    k = draw("kaiming_uniform_")
    assert k.abs().max() <= bound and k.abs().max() > 0.9 * bound


ORTHOGONAL = [({"x": 4}, (Shard(0),), (6, 5)), ({"x": 4}, (Shard(1),), (3, 7)), ({"x": 2}, (Shard(1),), (2, 4, 3)),
              ({"dp": 2, "tp": 2}, (Shard(1), Shard(0)), (5, 6)), ({"dp": 2, "tp": 2}, (Shard(0), Shard(0)), (7, 3)),
              ({"dp": 2, "tp": 2}, (R, Shard(1)), (4, 4))]


@pytest.mark.parametrize("dims, placements, shape", ORTHOGONAL)
def test_orthogonal_same_values_on_every_placement(dims: dict, placements: tuple, shape: tuple) -> None:
    """orthogonal_ (a QR of a normal draw, copied in through a view) gives the values one rank gives."""
    want = _orthogonal(reference_mesh({"x": 1}), (R,), shape, 3)
    got = _orthogonal(reference_mesh(dims), placements, shape, 3)
    assert torch.equal(got, want), (dims, placements, shape)
    flat = got.reshape(shape[0], -1)
    small = flat @ flat.T if flat.shape[0] <= flat.shape[1] else flat.T @ flat
    torch.testing.assert_close(small, 4.0 * torch.eye(small.shape[0]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dims, placements, shape", [({"x": 2}, (Partial("sum"),), (3, 4)),
                                                     ({"x": 4}, (Shard(0),), (1, 4))])
def test_orthogonal_on_partial_or_size_one_shards_is_refused(dims: dict, placements: tuple, shape: tuple) -> None:
    """orthogonal_ writes through `x.view_as(q)`; where that write would need the data moved (a Partial base,
    a shard of a size-1 dim), it would land in a copy: refused, never a value the base does not get."""
    with pytest.raises(UnsupportedOpError, match="copy_"):
        _orthogonal(reference_mesh(dims), placements, shape, 3)


def _orthogonal(mesh: Any, placements: tuple, shape: tuple, seed: int) -> torch.Tensor:
    monarch.manual_seed(seed)
    x = monarch.distribute_tensor(torch.zeros(shape), mesh, placements)
    with torch.no_grad():
        init.orthogonal_(x, gain=2.0)
    return x.full_tensor(timeout=T)


@pytest.mark.parametrize("placements", [(R, R), (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(2), Shard(0)),
                                        (Shard(0), Shard(0))])
def test_dirac_and_eye_equal_torch_on_sharded_dims(placements: tuple) -> None:
    """Their ones are written as `x[i, j, ...] = 1` along sharded dims: one masked write, torch's values."""
    mesh = reference_mesh({"dp": 2, "tp": 2})
    for shape, fn in (((4, 2, 3, 3), lambda t: init.dirac_(t, groups=2)), ((5, 3, 2), init.dirac_),
                      ((3, 5), init.eye_)):
        x = monarch.distribute_tensor(torch.full(shape, 7.0), mesh, placements[:len(shape)] if len(shape) > 2 else
                                      tuple(p if p == R or p.dim < 2 else R for p in placements))
        with torch.no_grad():
            fn(x)
        assert torch.equal(x.full_tensor(timeout=T), fn(torch.full(shape, 7.0))), (shape, placements)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


def test_model_built_under_activate_is_initialised_on_the_mesh_and_trains(procs: ProcMesh) -> None:
    monarch.manual_seed(5)
    with procs.activate():
        model = Model()
    params = dict(model.named_parameters())
    assert all(isinstance(p, monarch.MeshTensor) for p in params.values())
    mesh = reference_mesh({"dp": 2, "tp": 2})  # what the same seed gives on another mesh, drawn by nn.init
    monarch.manual_seed(5)
    want = {n: monarch.zeros(*p.shape, mesh=mesh) for n, p in params.items()}
    init.normal_(want["emb.weight"])
    init.kaiming_uniform_(want["fc.weight"], a=math.sqrt(5))
    init.uniform_(want["fc.bias"], -1 / math.sqrt(8), 1 / math.sqrt(8))
    for n, p in params.items():
        assert torch.equal(p.full_tensor(timeout=T), want[n].full_tensor(timeout=T)), n
    ids = monarch.distribute_tensor(torch.arange(12).remainder(10).reshape(4, 3), procs, {"dp": monarch.Shard(0)})
    target = monarch.distribute_tensor(torch.ones(4, 3, 4), procs, {"dp": monarch.Shard(0)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = ((model(ids) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
