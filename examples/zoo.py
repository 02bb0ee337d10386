"""The model zoo: small stock-PyTorch models, each with its data, loss and tensor-parallel plan.

nn.MultiheadAttention, nn.TransformerEncoder/Decoder, a LLaMA-style block, a small CNN and ResNet, and the
GPT of gpt.py; shared by the end-to-end tests and benchmarks/models.py. Plain torch (monarch is imported only
to build plans), no downloads; `Size` sets the sizes, tiny by default.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpt
import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, ...]  # the model's inputs, then the target


@dataclass(frozen=True)
class Size:
    batch: int = 4    # samples per step (the global batch)
    seq: int = 6      # tokens per sample
    width: int = 16   # features per token; channels of the first ResNet stage are width // 2
    layers: int = 1   # encoder, decoder and GPT layers
    image: int = 8    # image side of the CNN and ResNet
    classes: int = 5


CAUSAL = True  # the causal masks say so: else torch compares them with one, reading a value a compiled step lacks


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)


# -- attention models: (x, key padding mask) -> same shape as x ----------------------------------------------
class MHA(nn.Module):
    """nn.MultiheadAttention self-attention over (batch, seq, d) inputs, with optional masks."""
    attn_mask: torch.Tensor

    def __init__(self, size: Size, batch_first: bool = True, need_weights: bool = False, masks: bool = False) -> None:
        super().__init__()
        self.batch_first, self.need_weights, self.masks = batch_first, need_weights, masks
        self.attn = nn.MultiheadAttention(size.width, 4, batch_first=batch_first)
        self.register_buffer("attn_mask", causal_mask(size.seq))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = x if self.batch_first else x.transpose(0, 1)
        kwargs: dict[str, Any] = {"key_padding_mask": padding, "attn_mask": self.attn_mask} if self.masks else {}
        out, weights = self.attn(h, h, h, need_weights=self.need_weights, **kwargs)
        out = out if self.batch_first else out.transpose(0, 1)
        return out if weights is None else out + weights.sum(-1, keepdim=True)


class Encoder(nn.Module):
    """nn.TransformerEncoder with a causal mask and key padding."""
    src_mask: torch.Tensor

    def __init__(self, size: Size, norm_first: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(size.width, 4, 2 * size.width, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.register_buffer("src_mask", causal_mask(size.seq))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.enc(x, mask=self.src_mask, src_key_padding_mask=padding, is_causal=CAUSAL)


class Decoder(nn.Module):
    """nn.TransformerDecoder over a linear map of its own input as the memory."""
    tgt_mask: torch.Tensor

    def __init__(self, size: Size) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(size.width, 4, 2 * size.width, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, size.layers)
        self.memory = nn.Linear(size.width, size.width)
        self.register_buffer("tgt_mask", causal_mask(size.seq))

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

    def __init__(self, size: Size, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        d, hidden = size.width, 2 * size.width
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk, self.wv = (nn.Linear(d, kv_heads * self.hd, bias=False) for _ in range(2))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        freqs = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        angles = torch.outer(torch.arange(size.seq).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
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


# -- image models: (batch, 3, image, image) -> class logits --------------------------------------------------
class CNN(nn.Module):
    """Conv2d, BatchNorm2d (or nothing, without `norm`), ReLU and MaxPool2d twice, then a Linear head."""

    def __init__(self, size: Size = Size(), norm: bool = True) -> None:
        super().__init__()
        layer = (lambda c: nn.BatchNorm2d(c)) if norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), layer(4), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 6, 3, padding=1, bias=False), layer(6), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(6 * (size.image // 4) ** 2, size.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the identity, or a strided 1x1 conv-bn where the shape changes; then relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.down(x))


class ResNet(nn.Module):
    """A ResNet in miniature: conv-bn-relu stem, max pool, two stages of a BasicBlock (the second strided,
    with a downsample), adaptive average pool, fc."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        c = size.width // 2
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, padding=1))
        self.stages = nn.Sequential(BasicBlock(c, c), BasicBlock(c, 2 * c, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, size.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


def gpt_config(size: Size) -> gpt.GPTConfig:
    return gpt.GPTConfig(d_model=size.width, n_layer=size.layers, n_head=4, context=size.seq)


# -- data ------------------------------------------------------------------------------------------------------
def sequences(size: Size, n: int, seed: int = 1) -> list[Batch]:
    """(input, key padding mask, target) of shape (batch, seq, width); the last keys of every odd sample
    (two of the second's) are padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    shape = (size.batch, size.seq, size.width)
    for _ in range(n):
        x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        padding = torch.zeros(size.batch, size.seq, dtype=torch.bool)
        padding[1::2, -1:] = True
        padding[1, -2:] = True
        out.append((x, padding, y))
    return out


def images(size: Size, n: int, seed: int = 1) -> list[Batch]:
    """(images, class labels)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size.batch, 3, size.image, size.image, generator=g),
             torch.randint(0, size.classes, (size.batch,), generator=g)) for _ in range(n)]


WORDS = b"monarch mesh tensor shard replicate partial actor endpoint controller worker".split()


def text(size: Size, n: int, seed: int = 1) -> list[Batch]:
    """(bytes, next bytes) of shape (batch, seq) from seeded random sentences (fixed, unlike the repo's files)."""
    picks = torch.randint(0, len(WORDS), (4000,), generator=torch.Generator().manual_seed(seed))
    data = torch.tensor(list(b" ".join(WORDS[i] for i in picks.tolist())), dtype=torch.int64)
    stream = gpt.batches(data, size.batch, size.seq, seed)
    return [next(stream) for _ in range(n)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


# -- the zoo ---------------------------------------------------------------------------------------------------
Plan = Callable[[Size, int], dict[str, Any]]  # (size, tp) -> parallelize_module plan over mesh dim "tp"


@dataclass(frozen=True)
class Model:
    """How to build, feed and train one zoo model; `plan` is None where no tensor-parallel style applies."""
    name: str
    build: Callable[[Size], nn.Module]
    data: Callable[[Size, int, int], list[Batch]]  # (size, steps, seed) -> one batch per step
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    plan: Plan | None = None


def mha_plan(size: Size, tp: int) -> dict[str, Any]:
    """Only out_proj's weight: MultiheadAttention calls F.linear on it, so only the placement applies."""
    from monarch import RowwiseParallel
    return {"attn.out_proj": RowwiseParallel()}


def mlp_plan(size: Size, tp: int) -> dict[str, Any]:
    """The feed-forward of every encoder or decoder layer, column- then row-parallel."""
    from monarch import ColwiseParallel, RowwiseParallel
    return {"*.linear1": ColwiseParallel(), "*.linear2": RowwiseParallel()}


def llama_plan(size: Size, tp: int) -> dict[str, Any]:
    """Heads of q, k and v and the SwiGLU's hidden features over tp; wo and w2 row-parallel."""
    from monarch import ColwiseParallel, RowwiseParallel
    col, row = ColwiseParallel(), RowwiseParallel()
    return {"w[qkv]": col, "wo": row, "w[13]": col, "w2": row}


def gpt_plan(size: Size, tp: int) -> dict[str, Any]:
    return gpt.tp_plan(gpt_config(size), tp)


ZOO: dict[str, Model] = {m.name: m for m in [
    Model("encoder", Encoder, sequences, mse, mlp_plan),
    Model("llama", Llama, sequences, mse, llama_plan),
    Model("resnet", ResNet, images, F.cross_entropy),  # no plan: the tensor-parallel styles shard Linear layers
    Model("gpt", lambda size: gpt.GPT(gpt_config(size)), text, gpt.lm_loss, gpt_plan),
]}
VARIANTS: dict[str, Model] = {m.name: m for m in [  # more of the same kinds, for the tests
    Model("mha", MHA, sequences, mse, mha_plan),
    Model("mha-weights", lambda s: MHA(s, need_weights=True), sequences, mse, mha_plan),
    Model("mha-masks", lambda s: MHA(s, masks=True), sequences, mse, mha_plan),
    Model("mha-seq-first-masks-weights", lambda s: MHA(s, False, True, True), sequences, mse, mha_plan),
    Model("encoder-norm-first", lambda s: Encoder(s, norm_first=True), sequences, mse, mlp_plan),
    Model("decoder", Decoder, sequences, mse, mlp_plan),
    Model("cnn", CNN, images, F.cross_entropy),
]}


def train_step(model: nn.Module, opt: torch.optim.Optimizer,
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """One optimizer step on a batch (inputs..., target), returning the loss: what monarch.compile records."""
    def step(*batch: torch.Tensor) -> torch.Tensor:
        value = loss(model(*batch[:-1]), batch[-1])
        value.backward()
        opt.step()
        opt.zero_grad()
        return value
    return step


def optimizer(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    """SGD with momentum: AdamW would scale up the rounding noise of gradients that are zero in exact
    arithmetic (the key bias's: softmax ignores it) to differences of lr."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
