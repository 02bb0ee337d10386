"""parallelize_module, data_parallel and full_state_dict: eager training on MeshTensors against plain torch.

An MLP and a small GPT block (embedding, causal self-attention, MLP, layer norms, cross entropy) train a
few steps with SGD (momentum) and AdamW on meshes (dp), (tp) and (dp, tp), in both composition orders;
losses, parameters and optimizer state match single-process torch. Also: collectives per step,
gradient accumulation, no_grad evaluation, errors for bad plans, and one run on real processes.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import monarch
from monarch import ColwiseParallel, MeshError, MeshTensor, RowwiseParallel, SequenceParallel, Shard, ShardingError
from monarch.actor import ProcMesh
from monarch.runtime.session.local import LocalMesh
from monarch.runtime.session.session import session_of
from monarch.tensor.placement import R

T = 60.0  # seconds any single wait may take
STEPS = 3


# -- models ----------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    mask: torch.Tensor

    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.v, self.proj = (nn.Linear(d, d) for _ in range(3))
        self.k = nn.Linear(d, d, bias=False)  # a key bias gets no gradient (softmax ignores it)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        att = torch.softmax(att.masked_fill(~self.mask[:t, :t], float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class GPT(nn.Module):
    """One pre-norm transformer block between a token embedding and a language-model head."""

    def __init__(self, vocab: int = 16, d: int = 8, heads: int = 2, seq: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, d))
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, seq)
        self.mlp = MLP(d, 4 * d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


MLP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
GPT_PLAN = {"tok": RowwiseParallel(), "attn.[qkv]": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=R)}
SP_PLAN = {**GPT_PLAN, "tok": RowwiseParallel(output_layouts=Shard(1)), "ln*": SequenceParallel(),
           "attn.proj": RowwiseParallel(output_layouts=Shard(1)), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}


def mlp_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(n)]


def gpt_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)) for _ in range(n)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


KINDS = {"mlp": (MLP, MLP_PLAN, mlp_batches, mse), "gpt": (GPT, GPT_PLAN, gpt_batches, cross_entropy)}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


# -- helpers ---------------------------------------------------------------------------------------
def parallelize(model: nn.Module, mesh: Any, plan: dict, order: str = "dp_first") -> nn.Module:
    """data_parallel over dp and parallelize_module over tp (the plan only where the mesh has tp)."""
    dp = "dp" in mesh.extent
    plan = plan if "tp" in mesh.extent else {}
    if dp and order == "dp_first":
        monarch.data_parallel(model, mesh)
    monarch.parallelize_module(model, mesh, plan)
    if dp and order == "tp_first":
        monarch.data_parallel(model, mesh)
    return model


def value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`'s data (fetched, with a timeout, when it is a MeshTensor)."""
    return t.full_tensor(timeout=T) if isinstance(t, MeshTensor) else t


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn: Callable) -> list[float]:
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value(loss).item())
    return losses


def close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    full = monarch.full_state_dict(model, timeout=T)
    want = ref.state_dict()
    assert full.keys() == want.keys()
    for name, got in full.items():
        assert type(got) is torch.Tensor, name
        close(got, want[name], name)


def pair(kind: str, seed: int = 0) -> tuple[nn.Module, nn.Module, dict, Callable, Callable]:
    """A model, its untouched copy for plain torch, the plan, the batch maker and the loss."""
    make, plan, batches, loss = KINDS[kind]
    torch.manual_seed(seed)
    ref = make()
    return copy.deepcopy(ref), ref, plan, batches, loss


def collectives(mesh: Any, fn: Callable[[], Any]) -> list[str]:
    """The collectives `fn`'s tensor work ships (everything pending is shipped first)."""
    s = session_of(mesh)
    s.flush()
    n = len(s.collectives)
    out = fn()
    s.flush()
    del out
    return s.collectives[n:]


MESHES = [{"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}]
CASES = [(dims, order) for dims in MESHES for order in (["dp_first", "tp_first"] if len(dims) == 2 else ["-"])]


# -- training matches plain torch -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("dims, order", CASES, ids=[f"{'x'.join(d)}-{o}" for d, o in CASES])
def test_training_matches_torch(kind: str, opt_name: str, dims: dict, order: str) -> None:
    model, ref, plan, batches, loss_fn = pair(kind)
    mesh = LocalMesh(dims)
    parallelize(model, mesh, plan, order)
    assert all(isinstance(p, MeshTensor) and isinstance(p, nn.Parameter) and p.requires_grad
               for p in model.parameters())
    data = batches(STEPS)
    got = train(model, OPTIMIZERS[opt_name](model.parameters()), data, loss_fn)
    want = train(ref, OPTIMIZERS[opt_name](ref.parameters()), data, loss_fn)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert_same_params(model, ref)


def test_sequence_parallel_gpt_matches_torch() -> None:
    model, ref, _, batches, loss_fn = pair("gpt")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, SP_PLAN)
    assert model.ln1.weight.placements == (R, R)
    data = batches(STEPS)
    got = train(model, OPTIMIZERS["adamw"](model.parameters()), data, loss_fn)
    want = train(ref, OPTIMIZERS["adamw"](ref.parameters()), data, loss_fn)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert_same_params(model, ref)
    x = data[0][0]
    kinds = collectives(mesh, lambda: model(x))
    assert kinds.count("reduce_scatter[tp]") == 3 and "all_reduce[tp]" not in kinds, kinds


# -- placements, state dicts ------------------------------------------------------------------------
def test_placements_and_state_dict() -> None:
    model, ref, _, _, _ = pair("gpt")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, GPT_PLAN)
    want = {"tok.weight": Shard(0), "attn.q.weight": Shard(0), "attn.v.bias": Shard(0), "attn.proj.weight": Shard(1),
            "attn.proj.bias": R, "mlp.fc1.weight": Shard(0), "mlp.fc2.weight": Shard(1), "head.weight": Shard(0),
            "pos": R, "ln1.weight": R, "attn.mask": R}
    state = model.state_dict()
    assert state.keys() == ref.state_dict().keys()
    assert all(type(v) is MeshTensor for v in state.values())
    for name, p in want.items():
        assert state[name].placements == (R, p), name
    assert_same_params(model, ref)
    torch.manual_seed(5)
    other = GPT()
    model.load_state_dict(other.state_dict())  # plain tensors copied into the sharded parameters
    assert all(model.state_dict()[name].placements == (R, p) for name, p in want.items())
    assert_same_params(model, other)


def test_embedding_colwise_and_mesh_tensor_params_are_redistributed() -> None:
    mesh = LocalMesh({"dp": 2, "tp": 2})
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 4))
    model = copy.deepcopy(ref)
    model[1].weight = nn.Parameter(monarch.distribute_tensor(ref[1].weight, mesh, {"dp": Shard(1), "tp": Shard(0)}))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(output_layouts=monarch.Partial())}  # keeps the partial sum
    monarch.parallelize_module(model, mesh, plan)
    assert model[0].weight.placements == (R, Shard(1))
    assert model[1].weight.placements == (Shard(1), Shard(1)), "dp kept, tp redistributed"
    idx = torch.randint(0, 10, (3, 5))
    out = model(idx)
    assert out.placements == (monarch.Partial("sum"),) * 2
    close(value(out), ref(idx))


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, *, by: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, by


def test_data_parallel_shards_inputs() -> None:
    """Plain tensors (positional or keyword) become Shard(0) over dp; MeshTensors are redistributed there
    (keeping their tp placement); scalars are left alone."""
    mesh = LocalMesh({"dp": 2, "tp": 2})
    model = monarch.data_parallel(Scale(), mesh)
    x, by = torch.randn(5, 3), torch.randn(5, 3)
    a, b = model(x, by=monarch.distribute_tensor(by, mesh, {"tp": Shard(1)}))
    assert a.placements == (Shard(0), R) and b.placements == (Shard(0), Shard(1))
    close(value(a), x)
    close(value(b), by)
    scalar = torch.tensor(2.0)
    assert model(scalar, by=scalar)[0] is scalar


def test_optimizer_state_dict_gathers() -> None:
    model, ref, plan, batches, loss_fn = pair("mlp")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, plan)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    data = batches(2)
    train(model, opt, data, loss_fn)
    train(ref, ref_opt, data, loss_fn)
    assert type(opt.state_dict()["state"][0]["exp_avg"]) is MeshTensor
    got, want = monarch.full_state_dict(opt, timeout=T), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, state in want["state"].items():
        for key, value in state.items():
            assert type(got["state"][i][key]) is torch.Tensor
            close(got["state"][i][key], value, f"{i}.{key}")


# -- gradients: accumulation, no_grad ---------------------------------------------------------------
def test_gradient_accumulation() -> None:
    model, ref, plan, batches, loss_fn = pair("gpt")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, plan, "tp_first")
    for m in (model, ref):
        for x, y in batches(2):
            (loss_fn(m(x), y) / 2).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p.grad, MeshTensor)
        close(value(p.grad), q.grad, name)


def test_no_grad_eval_step() -> None:
    model, ref, plan, batches, loss_fn = pair("mlp")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, plan)
    x, y = batches(1)[0]
    with torch.no_grad():
        out = model(x)
        loss = loss_fn(out, y)
    assert not out.requires_grad and out.grad_fn is None
    assert all(p.grad is None for p in model.parameters())
    close(value(loss), loss_fn(ref(x), y))


# -- collectives ------------------------------------------------------------------------------------
def test_mlp_collectives_per_step() -> None:
    """Colwise -> Rowwise: one all_reduce over tp in forward and none in backward; with dp, one
    all_reduce over dp per parameter gradient when the optimizer reads it."""
    model, _, plan, batches, loss_fn = pair("mlp")
    mesh = LocalMesh({"tp": 2})
    parallelize(model, mesh, plan)
    x, y = batches(1)[0]
    assert collectives(mesh, lambda: model(x)) == ["all_reduce[tp]"]
    opt = OPTIMIZERS["sgd"](model.parameters())
    loss = loss_fn(model(x), y)
    assert collectives(mesh, loss.backward) == []
    assert collectives(mesh, opt.step) == []

    model, _, plan, batches, loss_fn = pair("mlp")
    mesh = LocalMesh({"dp": 2, "tp": 2})
    parallelize(model, mesh, plan)
    assert collectives(mesh, lambda: model(x)) == ["all_reduce[tp]"]
    opt = OPTIMIZERS["sgd"](model.parameters())
    loss = loss_fn(model(x), y)
    assert collectives(mesh, loss.backward) == []
    assert sorted(collectives(mesh, opt.step)) == ["all_reduce[dp]"] * 4


def test_gpt_forward_collectives_tp() -> None:
    """Rowwise embedding, attention projection and MLP output: one all_reduce each; the Colwise head with
    a replicated output: one all_gather. The batched q @ k.T and att @ v (monarch::matmul) keep the
    heads sharded, so attention itself moves nothing."""
    model, _, plan, batches, _ = pair("gpt")
    mesh = LocalMesh({"tp": 2})
    parallelize(model, mesh, plan)
    x = batches(1)[0][0]
    kinds = Counter(collectives(mesh, lambda: model(x)))
    assert kinds == {"all_reduce[tp]": 3, "all_gather[tp]": 1}, kinds


# -- errors -----------------------------------------------------------------------------------------
def test_errors_name_module_dim_and_fix() -> None:
    mesh = LocalMesh({"dp": 2, "tp": 2})
    with pytest.raises(MeshError, match=r"'fc1'.*no dim 'model'.*\['dp', 'tp'\]"):
        monarch.parallelize_module(MLP(), mesh, {"fc1": ColwiseParallel(dim="model")})
    with pytest.raises(ShardingError, match=r"RowwiseParallel\(dim='tp'\) cannot shard module 'ln1' \(LayerNorm\)"
                                            r".*SequenceParallel"):
        monarch.parallelize_module(GPT(), mesh, {"ln1": RowwiseParallel()})
    with pytest.raises(ShardingError, match=r"pattern 'fc3' matches no submodule of MLP.*fnmatch"):
        monarch.parallelize_module(MLP(), mesh, {"fc3": ColwiseParallel()})
    with pytest.raises(ShardingError, match=r"'mlp.fc1' is matched by plan patterns 'mlp.\*' and '\*fc1'"):
        monarch.parallelize_module(GPT(), mesh, {"mlp.*": ColwiseParallel(), "*fc1": RowwiseParallel()})
    with pytest.raises(MeshError, match=r"data_parallel\(MLP\): the mesh has no dim 'batch'"):
        monarch.data_parallel(MLP(), mesh, dim="batch")
    other = LocalMesh({"tp": 2})
    moved = monarch.parallelize_module(MLP(), other, {})
    with pytest.raises(MeshError, match=r"fc1.weight is a MeshTensor on .*not on"):
        monarch.parallelize_module(moved, mesh, {})


def test_tied_weights_stay_tied() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    ref[1].weight = ref[0].weight
    model = copy.deepcopy(ref)
    mesh = LocalMesh({"tp": 2})
    monarch.parallelize_module(model, mesh, {"0": RowwiseParallel(), "1": ColwiseParallel()})
    assert model[0].weight is model[1].weight and model[0].weight.placements == (Shard(0),)
    with pytest.raises(ShardingError, match=r"1.weight is shared with another module"):
        monarch.parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "1": ColwiseParallel()})


# -- real processes ---------------------------------------------------------------------------------
def test_training_on_procs(procs: ProcMesh) -> None:
    """The GPT trains on real worker processes (dp=2 x tp=2) as in plain torch; the MLP forward ships one
    all_reduce over tp there too."""
    model, ref, plan, batches, loss_fn = pair("gpt")
    parallelize(model, procs, plan)
    data = batches(STEPS)
    got = train(model, OPTIMIZERS["adamw"](model.parameters()), data, loss_fn)
    want = train(ref, OPTIMIZERS["adamw"](ref.parameters()), data, loss_fn)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert_same_params(model, ref)

    mlp, _, mlp_plan, mlp_data, _ = pair("mlp")
    parallelize(mlp, procs, mlp_plan, "tp_first")
    x = mlp_data(1)[0][0]
    assert collectives(procs, lambda: mlp(x)) == ["all_reduce[tp]"]


# -- compiled steps -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("dims", MESHES, ids=lambda d: "x".join(d))
def test_compiled_training_matches_torch_and_eager(kind: str, opt_name: str, dims: dict) -> None:
    """monarch.compile on the whole step (forward, backward, optimizer) gives plain torch's losses and
    parameters; the step is recorded twice (empty, then filled optimizer state) and then replayed."""
    model, ref, plan, batches, loss_fn = pair(kind)
    parallelize(model, LocalMesh(dims), plan)
    opt = OPTIMIZERS[opt_name](model.parameters())

    @monarch.compile
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = batches(5)
    got = [value(step(x, y)).item() for x, y in data]
    want = train(ref, OPTIMIZERS[opt_name](ref.parameters()), data, loss_fn)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert_same_params(model, ref)
    assert step.traces == 2


def test_autograd_grad_on_mesh_tensors() -> None:
    """torch.autograd.grad returns MeshTensors equal to plain torch's and leaves .grad alone."""
    mesh = LocalMesh({"dp": 2, "tp": 2})
    x0, w0 = torch.randn(5, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    x = monarch.distribute_tensor(x0.detach(), mesh, {"dp": Shard(0)}).requires_grad_(True)
    w = monarch.distribute_tensor(w0.detach(), mesh, {"tp": Shard(1)}).requires_grad_(True)
    got = torch.autograd.grad(torch.tanh(x @ w).pow(2).sum(), (x, w))
    want = torch.autograd.grad(torch.tanh(x0 @ w0).pow(2).sum(), (x0, w0))
    for g, h in zip(got, want, strict=True):
        close(value(g), h)
    assert x.grad is None and w.grad is None
