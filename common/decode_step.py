"""The arithmetic of one native decode step (common/decoding.py runs it): a Llama-family layer for a
prompt batch (prefill) and for one token per sequence (decode), and the choice of the next token.

    .venv/bin/python -m pytest -q tests/test_decoding.py

Written op for op as transformers' Llama / Qwen2 / Qwen3 modules compute (RMSNorm in float32, rotary
tables in float32 cast to the model's dtype, attention scaled by head_dim ** -0.5), so a float32 run
picks the tokens transformers' `generate` picks. Plain functions of tensors: torch.compile turns one
`decode_layer` into the step of every layer (the weights are arguments, not module state).
"""

from __future__ import annotations

from dataclasses import dataclass

CACHE_BLOCK = 128  # KV-cache lengths are multiples of FlexAttention's block: one block mask serves every step


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen; temperature 0 is greedy. `min_new_tokens` forbids end-of-sequence
    before that many tokens (transformers' `min_new_tokens`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def rms_norm(x, weight, eps: float):
    import torch

    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_tables(positions, inv_freq, scaling: float, dtype):
    """cos and sin [B, T, head_dim] for positions [B, T]."""
    import torch

    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _project(x, w, shape: Shape, cos, sin):
    """Norm, packed q/k/v projection, q/k norms and rotary embedding of x [B, T, hidden]:
    q [B, heads, T, D], k and v [B, kv_heads, T, D]."""
    import torch.nn.functional as F

    batch, tokens = x.shape[0], x.shape[1]
    qkv = F.linear(rms_norm(x, w["input_norm"], shape.eps), w["qkv"], w["qkv_bias"])
    q, k, v = qkv.split([shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                         shape.kv_heads * shape.head_dim], dim=-1)
    q = q.view(batch, tokens, shape.heads, shape.head_dim)
    k = k.view(batch, tokens, shape.kv_heads, shape.head_dim)
    if shape.qk_norm:
        q, k = rms_norm(q, w["q_norm"], shape.eps), rms_norm(k, w["k_norm"], shape.eps)
    v = v.view(batch, tokens, shape.kv_heads, shape.head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v


def _finish(x, attended, w, shape: Shape):
    """Output projection and residual, then norm and gated MLP; attended [B, heads, T, D]. Returns
    the residual stream and the MLP's output, which the next layer adds in its first kernel (the norm)
    rather than in a kernel of its own."""
    import torch.nn.functional as F

    batch, tokens = x.shape[0], x.shape[1]
    merged = attended.transpose(1, 2).reshape(batch, tokens, shape.heads * shape.head_dim)
    x = x + F.linear(merged, w["o"], w["o_bias"])
    gate, up = F.linear(rms_norm(x, w["post_norm"], shape.eps), w["gate_up"]).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, w["down"])


def prefill_layer(x, w, k_cache, v_cache, cos, sin, mask, shape: Shape):
    """One layer over whole prompts x [B, P, hidden] (left-padded; `mask` [B, 1, P, P] says which
    positions each one sees), their keys and values written at cache positions 0..P-1."""
    import torch.nn.functional as F

    q, k, v = _project(x, w, shape, cos, sin)
    k_cache[:, :, : x.shape[1]] = k
    v_cache[:, :, : x.shape[1]] = v
    k, v = k.repeat_interleave(shape.groups, dim=1), v.repeat_interleave(shape.groups, dim=1)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=shape.head_dim ** -0.5)
    x, mlp = _finish(x, attended, w, shape)
    return x + mlp


def decode_layer(x, delta, w, k_cache, v_cache, cos, sin, slot, visible, block_mask, shape: Shape):
    """One layer for one token per sequence, x + delta [B, 1, hidden] (the residual stream and the
    previous layer's MLP output; returned the same way), its key and value written at `slot`:
    FlexAttention over the cache blocks up to `slot` when `block_mask` is given (each sequence reads
    its cache only up to its current length), else two matmuls over the whole cache masked by
    `visible` [B, L] (any device)."""
    x = x + delta
    q, k, v = _project(x, w, shape, cos, sin)
    k_cache.index_copy_(2, slot, k)
    v_cache.index_copy_(2, slot, v)
    if block_mask is not None:
        from torch.nn.attention.flex_attention import flex_attention

        attended = flex_attention(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True,
                                  scale=shape.head_dim ** -0.5)
    else:
        attended = _matmul_attention(q, k_cache, v_cache, visible, shape)
    return _finish(x, attended, w, shape)


def _matmul_attention(q, k_cache, v_cache, visible, shape: Shape):
    """Grouped-query attention of one query per sequence: q [B, heads, 1, D], caches [B, kv_heads, L, D]."""
    import torch

    batch = q.shape[0]
    grouped = q.reshape(batch, shape.kv_heads, shape.groups, shape.head_dim)
    scores = torch.matmul(grouped, k_cache.transpose(-1, -2)) * shape.head_dim ** -0.5
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v_cache).reshape(batch, shape.heads, 1, shape.head_dim)


def decode_prologue(state, embed, inv_freq, rope_scaling: float, positions, kv_blocks):
    """The step's input: the last tokens' embeddings [B, 1, hidden], their rotary tables (each
    sequence's position counts its own tokens, left padding excluded, as `generate` counts), and which
    cache positions are visible: FlexAttention's block count when `kv_blocks` is given, else a mask."""
    import torch.nn.functional as F

    slot, start = state["slot"], state["start"]
    x = F.embedding(state["next"], embed)[:, None]
    cos, sin = rope_tables((slot - start)[:, None], inv_freq, rope_scaling, embed.dtype)
    if kv_blocks is not None:
        kv_blocks.copy_((slot // CACHE_BLOCK + 1).view(1, 1, 1))
        return x, cos, sin, None
    return x, cos, sin, (positions >= start[:, None]) & (positions <= slot)


def choose_token(logits, noise, eos_mask, sampling: Sampling):
    """The next token and its log-probability under softmax(logits / temperature), the distribution
    the trainer recomputes (top-k / top-p narrow the choice, not that log-probability), from float
    logits [B, V]; `noise` [B, V] ~ Exp(1) makes argmax(p / noise) a draw from p with no host sync
    (gpt-fast's trick). `eos_mask` [B, V]: end-of-sequence ids forbidden at this step."""
    import torch

    logits = logits.masked_fill(eos_mask, float("-inf"))
    if sampling.temperature == 0:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]
    scaled = logits / sampling.temperature
    kept = scaled
    if sampling.top_k > 0:
        kth = torch.topk(kept, min(sampling.top_k, kept.shape[-1]), dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = (probs.cumsum(dim=-1) - probs) > sampling.top_p  # mass before it already reaches top_p
        kept = kept.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    token = (torch.softmax(kept, dim=-1) / noise).argmax(dim=-1)
    return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None])[:, 0]


def decode_head(x, delta, norm, lm_head, noise, state, eos_ids, sampling: Sampling, eps: float):
    """Logits of x + delta [B, hidden] (the last layer's residual stream and MLP output), the next
    token, and the step's bookkeeping on the device: token and log-prob written at `slot + 1` (a
    finished sequence gets padding and 0), `finished` updated, `next` and `slot` moved on."""
    import torch
    import torch.nn.functional as F

    logits = F.linear(rms_norm(x + delta, norm, eps), lm_head).float()
    slot, finished = state["slot"], state["finished"]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    forbidden = torch.isin(vocab, eos_ids) & (slot < state["min_slot"])
    token, logprob = choose_token(logits, noise, forbidden[None, :].expand_as(logits), sampling)
    token = torch.where(finished, state["pad"], token)
    logprob = torch.where(finished, torch.zeros_like(logprob), logprob)
    state["tokens"].index_copy_(1, slot + 1, token[:, None])
    state["logprobs"].index_copy_(1, slot + 1, logprob[:, None])
    finished.logical_or_(torch.isin(token, eos_ids))
    state["next"].copy_(token)
    slot.add_(1)
