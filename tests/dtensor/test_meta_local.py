"""Meta-device initialisation on LocalMeshes: a model built under `torch.device("meta")` and parallelised
keeps meta MeshTensors (is_meta, placements as the styles give, nothing recorded or made), reading their data
raises the error naming to_empty + reset_parameters, `module.to_empty(device=...)` makes each piece with the
same placements, and reset_parameters / nn.init fill them: equal on every mesh and placement after the same
monarch.manual_seed, and drawn from plain torch's laws (their quantiles agree with torch's draws).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import init

import monarch
from monarch import LocalMesh, MonarchError, Replicate, Shard
from monarch.dtensor import distribute_module, distribute_tensor
from monarch.dtensor.debug import CommDebugMode
from monarch.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from monarch.errors import DeviceError
from monarch.runtime.session.session import session_of

R = Replicate()
FIX = ("to_empty", "reset_parameters")


class Net(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 12, vocab: int = 10) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.tok(x))
        return h + self.down(torch.relu(self.up(h)))


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def meta_net(mesh: LocalMesh, tp: object, **sizes: int) -> Net:
    with torch.device("meta"):
        net = Net(**sizes)
    return parallelize_module(net, tp, PLAN)


def reset(net: nn.Module) -> None:
    for m in net.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


def test_a_placed_meta_tensor_is_meta_and_records_nothing(mesh: LocalMesh) -> None:
    s = session_of(mesh)
    s.synchronize()
    ops, live = s.tracer.n_ops, s.metas
    w = distribute_tensor(torch.empty(6, 4, device="meta"), mesh, [R, Shard(0)])
    assert w.is_meta and w.device == torch.device("meta") and w.placements == (R, Shard(0))
    assert w.shape == (6, 4) and s.metas == live + 1
    v = w.t().reshape(2, 12)[:, :4] * 2  # ops on it: meta results, placed by the rules
    assert v.is_meta and w.t().placements == (R, Shard(1)) and (v.shape, v.dtype) == ((2, 4), torch.float32)
    with CommDebugMode() as comm:
        r = w.redistribute([Shard(1), R])
    assert r.is_meta and r.placements == (Shard(1), R) and comm.get_total_counts() == 0
    assert s.tracer.n_ops == ops and "device='meta'" in repr(w)
    del w, v, r
    assert s.metas == live


def test_a_meta_model_parallelised_keeps_placements_and_forward_refuses(mesh: LocalMesh) -> None:
    net = monarch.data_parallel(meta_net(mesh, mesh["tp"]), mesh, "dp")
    assert all(p.is_meta for p in net.parameters())
    assert net.up.weight.placements == (R, Shard(0)) and net.down.weight.placements == (R, Shard(1))
    assert net.ln.weight.placements == (R, R)
    with pytest.raises(DeviceError, match="to_empty.*reset_parameters"):
        net(torch.randint(0, 10, (4, 3)))


@pytest.mark.parametrize("read", ["item", "full_tensor", "fetch", "nonzero", "copy out", "copy in", "plain operand",
                                  "bool", "generator"])
def test_reading_meta_data_raises_naming_the_fix(mesh: LocalMesh, read: str) -> None:
    w = distribute_tensor(torch.empty(4, 6, device="meta"), mesh, [R, Shard(1)])
    reads: dict[str, Callable[[], object]] = {
        "item": lambda: w.sum().item(), "full_tensor": w.full_tensor, "fetch": lambda: monarch.fetch(w),
        "nonzero": w.nonzero, "copy out": lambda: torch.zeros(4, 6).copy_(w),
        "copy in": lambda: w.copy_(distribute_tensor(torch.ones(4, 6), mesh)),
        "plain operand": lambda: w + torch.ones(4, 6), "bool": lambda: bool((w > 0).any()),
        "generator": lambda: w.normal_(generator=torch.Generator().manual_seed(0)).sum().item(),
    }
    with pytest.raises(MonarchError) as e:
        reads[read]()
    assert isinstance(e.value, DeviceError) and all(f in str(e.value) for f in FIX), e.value


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_to_empty_makes_each_piece_with_its_placements(mesh: LocalMesh, device: object) -> None:
    net = monarch.data_parallel(meta_net(mesh, mesh["tp"]), mesh, "dp")
    want = {n: (p.shape, p.placements, p.requires_grad) for n, p in net.named_parameters()}
    net.to_empty(device=device)
    got = {n: (p.shape, p.placements, p.requires_grad) for n, p in net.named_parameters()}
    assert got == want and not any(p.is_meta for p in net.parameters())
    assert all(p.device == torch.device("cpu") and p.full_tensor().count_nonzero() == 0 for p in net.parameters())


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_to_empty_on_a_device_the_mesh_has_not_raises(mesh: LocalMesh, device: str) -> None:
    net = meta_net(mesh, mesh["tp"])
    with pytest.raises(DeviceError, match="cpu"):
        net.to_empty(device=device)


def test_reset_parameters_gives_the_same_values_on_every_mesh_and_placement() -> None:
    values = []
    for dims, tp in (({"x": 1}, None), ({"tp": 2}, "tp"), ({"dp": 2, "tp": 2}, "tp"), ({"tp": 4}, "tp")):
        m = LocalMesh(dims)
        net = meta_net(m, m[tp]) if tp else distribute_module(_meta(Net), m)
        net.to_empty(device="cpu")
        monarch.manual_seed(5)
        reset(net)
        values.append(monarch.full_state_dict(net))
    for v in values[1:]:
        assert v.keys() == values[0].keys() and all(torch.equal(v[k], values[0][k]) for k in v)
    assert not torch.equal(values[0]["up.weight"], values[0]["down.weight"].t())  # distinct draws


def _meta(cls: type[nn.Module], *args: int) -> nn.Module:
    with torch.device("meta"):
        return cls(*args)


INITS: dict[str, Callable[[torch.Tensor], object]] = {
    "Linear.reset_parameters": lambda w: init.kaiming_uniform_(w, a=math.sqrt(5)),
    "uniform_": lambda w: init.uniform_(w, -0.3, 0.7),
    "normal_": lambda w: init.normal_(w, 0.5, 2.0),
    "trunc_normal_": lambda w: init.trunc_normal_(w, std=0.02),
    "xavier_uniform_": init.xavier_uniform_,
    "kaiming_normal_": init.kaiming_normal_,
}


@pytest.mark.parametrize("name", sorted(INITS))
def test_inits_follow_plain_torchs_laws(mesh: LocalMesh, name: str) -> None:
    """Seeded equality with torch is impossible (monarch's stream is its own): the quantiles of a 96k-value
    draw agree with torch's to a few hundredths of the spread, and the bounds hold."""
    w = distribute_tensor(torch.empty(256, 384, device="meta"), mesh, [Shard(0), Shard(1)])
    w = torch.empty_like(w, device=None)  # what module.to_empty(device=None) does
    assert w.placements == (Shard(0), Shard(1)) and not w.is_meta
    monarch.manual_seed(0)
    INITS[name](w)
    got = w.full_tensor().flatten()
    torch.manual_seed(0)
    want = torch.empty(256, 384)
    INITS[name](want)
    q = torch.linspace(0.02, 0.98, 97)
    spread = want.std().item()
    assert (got.quantile(q) - want.flatten().quantile(q)).abs().max() < 0.05 * spread, name
    assert got.min() >= want.min() - 0.2 * spread and got.max() <= want.max() + 0.2 * spread
    if name == "Linear.reset_parameters":
        assert got.abs().max() <= 1 / math.sqrt(384)


def test_module_reset_parameters_after_to_empty(mesh: LocalMesh) -> None:
    net = meta_net(mesh, mesh["tp"], d=64, hidden=256, vocab=300).to_empty(device=None)
    monarch.manual_seed(0)
    reset(net)
    sd = monarch.full_state_dict(net)
    assert torch.equal(sd["ln.weight"], torch.ones(64)) and torch.equal(sd["ln.bias"], torch.zeros(64))
    assert sd["up.weight"].abs().max() <= 1 / 8 and sd["up.bias"].abs().max() <= 1 / 8
    assert sd["down.weight"].abs().max() <= 1 / 16 and sd["up.weight"].std() > 0.6 / 8 / math.sqrt(3)
    tok = sd["tok.weight"]
    assert abs(tok.mean().item()) < 0.03 and abs(tok.std().item() - 1) < 0.03  # N(0, 1), 19200 draws
