"""A small GPT-style byte-level language model, its training text and the tensor-parallel plan.

Shared by the demo, the train-vs-DDP benchmark and the tests. Plain torch only: the same module
trains on a laptop CPU or, with its parameters made MeshTensors, on a monarch mesh.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    context: int = 64
    vocab: int = VOCAB
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        assert self.d_model % self.n_head == 0, f"d_model {self.d_model} must split over {self.n_head} heads"


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention from matmuls, a mask and softmax.

    `qkv`'s output features are laid out head-major ([head][q, k, v][head_dim]), so sharding them in
    equal contiguous chunks (column parallel) gives every shard whole heads with their q, k and v.
    """

    mask: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, self.n_head, 3 * self.head_dim).transpose(1, 2).split(self.head_dim, -1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, final norm, untied head."""
    positions: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.register_buffer("positions", torch.arange(cfg.context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The model with weights drawn from `seed` (the same on every process that asks)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tp_plan(cfg: GPTConfig, tp: int) -> dict[str, Any]:
    """The parallelize_module plan over a mesh dim "tp" of size `tp`: Megatron-style column- then
    row-parallel pairs in attention and MLP, every shard holding whole heads."""
    if cfg.n_head % tp:
        raise ValueError(f"{cfg.n_head} heads do not split evenly over tp={tp}; pick n_head a multiple of tp")
    import monarch
    col, row = monarch.ColwiseParallel(dim="tp"), monarch.RowwiseParallel(dim="tp")
    return {"blocks.*.attn.qkv": col, "blocks.*.attn.out": row, "blocks.*.mlp.up": col, "blocks.*.mlp.down": row}


# -- data ------------------------------------------------------------------------------------------------
SKIP_DIRS = {"build", "node_modules", "__pycache__"}


def load_text(root: Path = REPO, min_bytes: int = 1 << 16) -> torch.Tensor:
    """The bytes of every *.py and *.md file under `root` (sorted by path, hidden dirs skipped) as int64."""
    chunks = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name.endswith((".py", ".md")):
                chunks.append((Path(dirpath) / name).read_bytes())
    data = b"\n".join(chunks)
    assert len(data) >= min_bytes, f"only {len(data)} bytes of text under {root}"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, context: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, deterministic stream of (input, next-byte target) pairs of shape (batch, context)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch, 1), generator=gen)
        window = data[starts + offsets]
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One optimizer step on a batch, returning the loss: the function monarch.compile records.
    `model` maps inputs to logits (a GPT, or a wrapper such as DistributedDataParallel)."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def compile_step(step: Callable[..., Any], eager: bool = False) -> Callable[..., Any]:
    """`step` under monarch.compile (one traced program per step), or as it is when `eager`."""
    if eager:
        return step
    import monarch
    return monarch.compile(step)


def train_torch(cfg: GPTConfig, steps: int, batch: int, seed: int = 0, lr: float = 1e-3,
                data: torch.Tensor | None = None, progress: Callable[[float], None] | None = None) -> list[float]:
    """The baseline: plain single-process torch; returns the loss of every step."""
    model = build(cfg, seed)
    step = train_step(model, optimizer(model, lr))
    stream = batches(load_text() if data is None else data, batch, cfg.context, seed)
    losses = []
    for _ in range(steps):
        losses.append(step(*next(stream)).item())
        if progress is not None:
            progress(losses[-1])
    return losses
