"""Stock PyTorch attention models train sharded: nn.MultiheadAttention (need_weights either way, key
padding and attention masks, batch first or not), nn.TransformerEncoder and nn.TransformerDecoder, and a
LLaMA-style block (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention through SDPA). On meshes
dp=2, tp=2 and dp=2 x tp=2, eager and compiled, five steps give the losses and parameters of plain torch,
with every op covered by a sharding rule (MONARCH_STRICT=1); once on real processes.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import monarch
from monarch import ColwiseParallel, MeshTensor, RowwiseParallel
from monarch.actor import ProcMesh
from monarch.runtime.session.local import LocalMesh

T = 60.0  # seconds any single wait may take
STEPS, BATCH, SEQ, D = 5, 4, 6, 16
pytestmark = pytest.mark.usefixtures("strict")


# -- models ----------------------------------------------------------------------------------------
class MHA(nn.Module):
    """nn.MultiheadAttention self-attention over (batch, seq, d) inputs, with optional masks."""
    attn_mask: torch.Tensor

    def __init__(self, batch_first: bool, need_weights: bool, masks: bool) -> None:
        super().__init__()
        self.batch_first, self.need_weights, self.masks = batch_first, need_weights, masks
        self.attn = nn.MultiheadAttention(D, 4, batch_first=batch_first)
        self.register_buffer("attn_mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = x if self.batch_first else x.transpose(0, 1)
        kwargs: dict[str, Any] = {"key_padding_mask": padding, "attn_mask": self.attn_mask} if self.masks else {}
        out, weights = self.attn(h, h, h, need_weights=self.need_weights, **kwargs)
        out = out if self.batch_first else out.transpose(0, 1)
        return out if weights is None else out + weights.sum(-1, keepdim=True)


CAUSAL = True  # the causal masks say so: else torch compares them with one, reading a value a compiled step lacks


class Encoder(nn.Module):
    src_mask: torch.Tensor

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.register_buffer("src_mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.enc(x, mask=self.src_mask, src_key_padding_mask=padding, is_causal=CAUSAL)


class Decoder(nn.Module):
    tgt_mask: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, 4, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.memory = nn.Linear(D, D)
        self.register_buffer("tgt_mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.dec(x, self.memory(x), tgt_mask=self.tgt_mask, memory_key_padding_mask=padding,
                        tgt_is_causal=CAUSAL)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Llama(nn.Module):
    """One pre-norm LLaMA block: RMSNorm, rotary q/k, grouped-query causal SDPA, SwiGLU MLP."""
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, D // heads
        self.norm1, self.norm2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.wq, self.wo = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.wk, self.wv = (nn.Linear(D, kv_heads * self.hd, bias=False) for _ in range(2))
        self.w1, self.w3 = nn.Linear(D, hidden, bias=False), nn.Linear(D, hidden, bias=False)
        self.w2 = nn.Linear(hidden, D, bias=False)
        freqs = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        angles = torch.outer(torch.arange(SEQ).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = (z * self.cos + rotate_half(z) * self.sin for z in (q, k))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mha": lambda: MHA(True, False, False), "mha-weights": lambda: MHA(True, True, False),
    "mha-masks": lambda: MHA(True, False, True), "mha-seq-first-masks-weights": lambda: MHA(False, True, True),
    "encoder": Encoder, "encoder-norm-first": lambda: Encoder(True), "decoder": Decoder, "llama": Llama,
}
MLP_PLAN = {"*.linear1": ColwiseParallel(), "*.linear2": RowwiseParallel()}
OUT_PROJ = {"attn.out_proj": RowwiseParallel()}  # its weight only: MultiheadAttention calls F.linear on it
PLANS: dict[str, dict] = {
    "mha": OUT_PROJ, "mha-weights": OUT_PROJ, "mha-masks": OUT_PROJ, "mha-seq-first-masks-weights": OUT_PROJ,
    "encoder": MLP_PLAN, "encoder-norm-first": MLP_PLAN, "decoder": MLP_PLAN,
    "llama": {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel(), "w[13]": ColwiseParallel(),
              "w2": RowwiseParallel()},
}


# -- training ----------------------------------------------------------------------------------------
def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input, key padding mask, target); the last keys of some samples are padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)
        padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        padding[1, -2:] = padding[3, -1:] = True
        out.append((x, padding, y))
    return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, padding: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((model(x, padding) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor(timeout=T) if isinstance(t, MeshTensor) else t


def train(model: nn.Module, data: list, compiled: bool = False) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # AdamW would scale up the rounding noise
    # of gradients that are zero in exact arithmetic (the key bias's: softmax ignores it) to differences of lr
    step = train_step(model, opt)
    step = monarch.compile(step) if compiled else step
    losses = []
    for x, padding, y in data:
        losses.append(value(step(x, padding, y)).item())
    return losses


def parallelize(model: nn.Module, mesh: Any, kind: str) -> nn.Module:
    if "dp" in mesh.extent:
        monarch.data_parallel(model, mesh)
    monarch.parallelize_module(model, mesh, PLANS.get(kind, {}) if "tp" in mesh.extent else {})
    return model


def check_same(kind: str, mesh: Any, compiled: bool) -> None:
    torch.manual_seed(0)
    ref = MODELS[kind]()
    model = parallelize(copy.deepcopy(ref), mesh, kind)
    data = batches(STEPS)
    got = train(model, data, compiled)
    want = train(ref, data)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    full = monarch.full_state_dict(model, timeout=T)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


MESHES = [{"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dims", MESHES, ids=["x".join(d) for d in MESHES])
@pytest.mark.parametrize("kind", list(MODELS))
def test_training_matches_torch(kind: str, dims: dict[str, int], compiled: bool) -> None:
    check_same(kind, LocalMesh(dims), compiled)


def test_llama_attention_keeps_heads_sharded() -> None:
    """Under the tensor-parallel plan the attention itself moves nothing over tp: one all_reduce each
    after wo and w2, none before."""
    torch.manual_seed(0)
    mesh = LocalMesh({"tp": 2})
    model = parallelize(Llama(), mesh, "llama")
    x = monarch.distribute_tensor(torch.randn(2, SEQ, D), mesh, [monarch.Replicate()])
    s = mesh._session
    s.flush()
    n = len(s.collectives)
    out = model(x, None)
    s.flush()
    del out
    assert s.collectives[n:] == ["all_reduce[tp]", "all_reduce[tp]"], s.collectives[n:]


@pytest.mark.parametrize("kind", ["mha-seq-first-masks-weights", "llama"])
def test_training_on_procs(procs: ProcMesh, kind: str) -> None:
    check_same(kind, procs, compiled=True)
