"""`F.multi_head_attention_forward` on MeshTensors, with the batch dim kept apart from the heads.

torch's version merges batch with heads (`view(seq, batch * heads, head_dim)`) and seq with batch
before the output projection (`view(seq * batch, embed)`); a shard of the batch cannot follow either
merge unless it divides evenly, and not the second at all, so a data-parallel step would move its
activations. Here q, k and v are (batch, heads, seq, head_dim) views and the projections are
`monarch::linear` on (seq, batch, embed): batch stays sharded throughout. Same values as torch's.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_UNSUPPORTED = ("bias_k", "bias_v", "static_k", "static_v")  # torch's own version runs these


def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """torch's semantics, or NotImplemented for the options left to torch's version (bias_k/bias_v,
    static keys and values, add_zero_attn)."""
    a = _SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    o = a.arguments
    if o["add_zero_attn"] or any(o[n] is not None for n in _UNSUPPORTED):
        return NotImplemented
    return _forward(o)


def _forward(o: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    query, key, value, heads = o["query"], o["key"], o["value"], o["num_heads"]
    batched = F._mha_shape_check(query, key, value, o["key_padding_mask"], o["attn_mask"], heads)
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    tgt, bsz, embed = query.shape
    src = key.shape[0]
    if embed != o["embed_dim_to_check"] or embed % heads:
        raise AssertionError(f"embedding dim {embed}: expected {o['embed_dim_to_check']}, divisible by {heads} heads")
    mask, is_causal = _mask(o, query, bsz, heads, tgt, src, batched)
    q, k, v = _project(o, query, key, value)
    hd = embed // heads
    q, k, v = (t.view(t.shape[0], bsz, heads, hd).permute(1, 2, 0, 3) for t in (q, k, v))  # (B, H, L, hd)
    dropout_p = o["dropout_p"] if o["training"] else 0.0
    weights = None
    if o["need_weights"]:
        scores = (q * math.sqrt(1.0 / float(hd))) @ k.transpose(-2, -1)
        weights = F.softmax(scores if mask is None else scores + mask, dim=-1)
        out = (F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights) @ v
        weights = weights.mean(dim=1) if o["average_attn_weights"] else weights
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
    out = F.linear(out.permute(2, 0, 1, 3).reshape(tgt, bsz, embed), o["out_proj_weight"], o["out_proj_bias"])
    if not batched:
        out = out.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    return out, weights


def _project(o: dict[str, Any], query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-projections (seq, batch, embed) of query, key and value, packed or separate weights."""
    if not o["use_separate_proj_weight"]:
        return F._in_projection_packed(query, key, value, o["in_proj_weight"], o["in_proj_bias"])
    b = o["in_proj_bias"]
    bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
    return F._in_projection(query, key, value, o["q_proj_weight"], o["k_proj_weight"], o["v_proj_weight"], bq, bk, bv)


def _mask(o: dict[str, Any], query: torch.Tensor, bsz: int, heads: int, tgt: int, src: int,
          batched: bool) -> tuple[torch.Tensor | None, bool]:
    """The additive float mask broadcasting to (B, H, L, S), or None, and whether attention is causal
    (torch's rules: a causal hint drops the mask only without padding and weights)."""
    padding, attn_mask, is_causal = o["key_padding_mask"], o["attn_mask"], o["is_causal"]
    if padding is not None and not batched:
        padding = padding.unsqueeze(0)
    padding = F._canonical_mask(mask=padding, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
                                other_name="attn_mask", target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and padding is None and not o["need_weights"]:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        is_causal = is_causal and padding is None
    if attn_mask is not None:
        want = (tgt, src) if attn_mask.dim() == 2 else (bsz * heads, tgt, src)
        if tuple(attn_mask.shape) != want:
            raise RuntimeError(f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, but "
                               f"should be {want}.")
        attn_mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(bsz, heads, tgt, src)
    if padding is not None:
        if tuple(padding.shape) != (bsz, src):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src)}, but got {tuple(padding.shape)}")
        padding = padding.view(bsz, 1, 1, src)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    return attn_mask, is_causal
