"""The arithmetic of one native decode step (generation/decoding.py runs it): a Llama-family layer for a
prompt batch (prefill) and for one token per sequence (decode), and the choice of the next token.

    .venv/bin/python -m pytest -q tests/test_decoding.py

Written op for op as transformers' Llama / Qwen2 / Qwen3 modules compute (RMSNorm in float32, rotary
tables in float32 cast to the model's dtype, attention scaled by head_dim ** -0.5), so a float32 run
picks the tokens transformers' `generate` picks. Plain functions of tensors: torch.compile turns one
`decode_layer` into the step of every layer (the weights are arguments, not module state).
"""

from __future__ import annotations

from dataclasses import dataclass

CACHE_BLOCK = 128  # KV-cache lengths are multiples of this (and of FlexAttention's block, which divides it)


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


@dataclass(frozen=True)
class Splits:
    """Into how many slices of their inner dimension the decode step's four products are split (1: one
    matmul). A product of few rows (decoding B sequences) gets few thread blocks, which cannot keep
    enough loads in flight to read a weight at memory speed; `splits` slices give it that many times
    the blocks, their float32 partial products summed by the kernel that consumes the result."""

    qkv: int = 1
    o: int = 1
    gate_up: int = 1
    down: int = 1


def product_splits(hidden: int, width: int, kv_width: int, intermediate: int, batch: int) -> Splits:
    """Each product no wider than its input (attention's output, `width` -> hidden, and the MLP's down
    projection) split into up to 4 slices of >= 384 (up to 2 from 256 sequences on, which already give
    cuBLAS thread blocks enough); the widening ones (q/k/v, gate/up) whole. Measured on an H200
    (bench/results-h200-decode-profile.json): at 64 rows split 4 ways the two narrowing products read
    their weights at 1.0-1.4 TB/s against 0.7-0.9 whole; 8 ways gained in the product and lost more in
    summing the partials; the widening products only lost."""

    def slices(inner: int, outer: int) -> int:
        count = 1
        while (outer <= inner and count * 2 <= (4 if batch <= 128 else 2) and inner % (count * 2) == 0
               and inner // (count * 2) >= 384):
            count *= 2
        return count

    return Splits(qkv=slices(hidden, width + kv_width), o=slices(width, hidden),
                  gate_up=slices(hidden, 2 * intermediate), down=slices(intermediate, hidden))


def partial_products(x, w, splits: int):
    """x [..., K] times w [N, K] transposed, as [splits, ..., N]: with splits > 1, the products of x's
    and w's `splits` slices of K, in float32 (one batched matmul over views of w: no copy)."""
    import torch
    import torch.nn.functional as F

    if splits == 1:
        return F.linear(x, w)[None]
    rows, inner, out = x.shape[:-1], x.shape[-1], w.shape[0]
    part = inner // splits
    a, b = x.reshape(-1, splits, part).transpose(0, 1), w.view(out, splits, part).permute(1, 2, 0)
    # CUDA accumulates bf16 in float32 and keeps it; elsewhere bmm has no out_dtype: upcast first
    products = torch.bmm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.bmm(a.float(), b.float())
    return products.view(splits, *rows, out)


def merged(parts, dtype):
    """The sum of partial products [S, ...] (unrolled: pointwise, so it fuses into its consumer), rounded
    to `dtype` as one matmul's output is."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.to(dtype)


def _linear(x, w, bias, splits: int):
    import torch.nn.functional as F

    if splits == 1:
        return F.linear(x, w, bias)
    out = merged(partial_products(x, w, splits), x.dtype)
    return out if bias is None else out + bias


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


def _project(x, w, shape: Shape, cos, sin, splits: Splits):
    """Norm, packed q/k/v projection, q/k norms and rotary embedding of x [B, T, hidden]: q [B, heads,
    T, D] and the keys and values as one [B, 2 x kv_heads, T, D] (keys first), so that one kernel
    computes both and writes them into the cache (generation/decoding.py keeps a layer's keys and values
    in one tensor)."""
    import torch

    batch, tokens, kv_heads = x.shape[0], x.shape[1], shape.kv_heads
    qkv = _linear(rms_norm(x, w["input_norm"], shape.eps), w["qkv"], w["qkv_bias"], splits.qkv)
    q = qkv[..., : shape.heads * shape.head_dim].view(batch, tokens, shape.heads, shape.head_dim)
    kv = qkv[..., shape.heads * shape.head_dim:].view(batch, tokens, 2 * kv_heads, shape.head_dim)
    keys = kv
    if shape.qk_norm:
        q, keys = rms_norm(q, w["q_norm"], shape.eps), rms_norm(kv, w["k_norm"], shape.eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    is_key = (torch.arange(2 * kv_heads, device=x.device) < kv_heads)[:, None, None]
    kv = torch.where(is_key, _rotate(keys.transpose(1, 2), cos, sin), kv.transpose(1, 2))
    return _rotate(q.transpose(1, 2), cos, sin), kv


def _finish(x, attended, w, shape: Shape, splits: Splits):
    """Output projection and residual, then norm and gated MLP; attended [B, heads, T, D]. Returns
    the residual stream and the MLP's output as partial products [S, B, T, hidden], which the next
    layer adds in its first kernel (the norm) rather than in a kernel of its own."""
    import torch.nn.functional as F

    batch, tokens = x.shape[0], x.shape[1]
    heads = attended.transpose(1, 2).reshape(batch, tokens, shape.heads * shape.head_dim)
    x = x + _linear(heads, w["o"], w["o_bias"], splits.o)
    gate, up = _linear(rms_norm(x, w["post_norm"], shape.eps), w["gate_up"], None, splits.gate_up).chunk(2, dim=-1)
    return x, partial_products(F.silu(gate) * up, w["down"], splits.down)


def prefill_layer(x, w, kv_cache, cos, sin, mask, shape: Shape):
    """One layer over whole prompts x [B, P, hidden] (left-padded; `mask` [B, 1, P, P] says which
    positions each one sees), their keys and values written at cache positions 0..P-1 of `kv_cache`
    [B, 2 x kv_heads, L, D] (keys first)."""
    import torch.nn.functional as F

    q, kv = _project(x, w, shape, cos, sin, Splits())
    kv_cache[:, :, : x.shape[1]] = kv
    k, v = kv.repeat_interleave(shape.groups, dim=1).chunk(2, dim=1)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=shape.head_dim ** -0.5)
    x, mlp = _finish(x, attended, w, shape, Splits())
    return x + mlp[0]


def decode_layer(x, delta, w, kv_cache, cos, sin, slot, visible, block_mask, shape: Shape, splits: Splits,
                 flex_options: dict | None = None):
    """One layer for one token per sequence, x + delta (the residual stream [B, 1, hidden] and the
    previous layer's MLP output as partial products [S, B, 1, hidden]; returned the same way), its key
    and value written at `slot`:
    FlexAttention over the cache blocks up to `slot` when `block_mask` is given (each sequence reads
    its cache only up to its current length), else two matmuls over the whole cache masked by
    `visible` [B, L] (any device)."""
    x = x + merged(delta, x.dtype)
    q, kv = _project(x, w, shape, cos, sin, splits)
    kv_cache.index_copy_(2, slot, kv)
    k_cache, v_cache = kv_cache.chunk(2, dim=1)
    if block_mask is not None:
        from torch.nn.attention.flex_attention import flex_attention

        attended = flex_attention(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True,
                                  scale=shape.head_dim ** -0.5, kernel_options=flex_options)
    else:
        attended = _matmul_attention(q, k_cache, v_cache, visible, shape)
    return _finish(x, attended, w, shape, splits)


def _matmul_attention(q, k_cache, v_cache, visible, shape: Shape):
    """Grouped-query attention of one query per sequence: q [B, heads, 1, D], caches [B, kv_heads, L, D]."""
    import torch

    batch = q.shape[0]
    grouped = q.reshape(batch, shape.kv_heads, shape.groups, shape.head_dim)
    scores = torch.matmul(grouped, k_cache.transpose(-1, -2)) * shape.head_dim ** -0.5
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v_cache).reshape(batch, shape.heads, 1, shape.head_dim)


def decode_prologue(state, embed, inv_freq, rope_scaling: float, positions, kv_blocks, kv_block: int):
    """The step's input: the last tokens' embeddings [B, 1, hidden], their rotary tables (each
    sequence's position counts its own tokens, left padding excluded, as `generate` counts), and which
    cache positions are visible: FlexAttention's block count when `kv_blocks` is given, else a mask."""
    import torch.nn.functional as F

    slot, start = state["slot"], state["start"]
    x = F.embedding(state["next"], embed)[:, None]
    cos, sin = rope_tables((slot - start)[:, None], inv_freq, rope_scaling, embed.dtype)
    if kv_blocks is not None:
        kv_blocks.copy_((slot // kv_block + 1).view(1, 1, 1))
        return x, cos, sin, None
    return x, cos, sin, (positions >= start[:, None]) & (positions <= slot)


VOCAB_CHUNK = 1024  # logits reduced in chunks of this many: B x V / 1024 rows keep every multiprocessor busy


def _chunked(values):
    """[B, V] as [B, C, L] chunks of at most VOCAB_CHUNK (the tail padded with -inf): a reduction over
    a vocabulary runs as B x C rows, not B long ones that leave most of the GPU idle."""
    import torch.nn.functional as F

    vocab = values.shape[-1]
    chunks = -(-vocab // VOCAB_CHUNK)
    length = -(-vocab // chunks)
    return F.pad(values, (0, chunks * length - vocab), value=float("-inf")).view(values.shape[0], chunks, length)


def _argmax(values):
    """The first index of each row's largest value (torch.argmax's answer), reduced chunk by chunk."""
    chunks = _chunked(values)
    best, where = chunks.max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * chunks.shape[-1] + where.gather(-1, chunk))[:, 0]


def _chunk_masses(chunks):
    """log sum exp of each chunk [B, C, L] -> [B, C] (a chunk all -inf: -inf, not NaN)."""
    import torch

    peak = chunks.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(chunks.dtype).min)
    return peak[..., 0] + (chunks - peak).exp().sum(dim=-1).log()


def _log_prob(values, token, masses=None):
    """log softmax(values)[token] per row, its normaliser summed from the chunks' masses."""
    masses = _chunk_masses(_chunked(values)) if masses is None else masses
    return values.gather(-1, token[:, None])[:, 0] - masses.logsumexp(dim=-1)


def _draw(values):
    """A draw from softmax(values) per row [B, V], and the chunks' log-masses: first a chunk by its
    mass, then a token inside it (P = mass share x share within the chunk), each by the Gumbel-max
    trick (argmax of log p - log E, E ~ Exp(1)): B x (C + L) random numbers, not B x V."""
    import torch

    chunks = _chunked(values)
    masses = _chunk_masses(chunks)
    chunk = (masses - torch.empty_like(masses).exponential_().log()).argmax(dim=-1)
    inside = chunks.gather(1, chunk[:, None, None].expand(-1, 1, chunks.shape[-1]))[:, 0]
    pick = (inside - torch.empty_like(inside).exponential_().log()).argmax(dim=-1)
    return chunk * chunks.shape[-1] + pick, masses


def choose_token(logits, eos_mask, sampling: Sampling):
    """The next token and its log-probability under softmax(logits / temperature), the distribution
    the trainer recomputes (top-k / top-p narrow the choice, not that log-probability), from float
    logits [B, V], on the device with no host sync (`_draw`). `eos_mask` [B, V]: end-of-sequence ids
    forbidden at this step."""
    import torch

    logits = logits.masked_fill(eos_mask, float("-inf"))
    if sampling.temperature == 0:
        token = _argmax(logits)
        return token, _log_prob(logits, token)
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
    token, masses = _draw(kept)
    return token, _log_prob(scaled, token, masses if kept is scaled else None)


def decode_head(x, delta, norm, lm_head, state, eos_ids, sampling: Sampling, eps: float):
    """Logits of x + delta (the last layer's residual stream [B, hidden] and MLP output as partial
    products [S, B, hidden]), the next token, and the step's bookkeeping on the device: token and
    log-prob written at `slot + 1` (a finished sequence gets padding and 0), `finished` updated, `next`
    and `slot` moved on."""
    import torch
    import torch.nn.functional as F

    logits = F.linear(rms_norm(x + merged(delta, x.dtype), norm, eps), lm_head).float()
    slot, finished = state["slot"], state["finished"]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    forbidden = torch.isin(vocab, eos_ids) & (slot < state["min_slot"])
    token, logprob = choose_token(logits, forbidden[None, :].expand_as(logits), sampling)
    token = torch.where(finished, state["pad"], token)
    logprob = torch.where(finished, torch.zeros_like(logprob), logprob)
    state["tokens"].index_copy_(1, slot + 1, token[:, None])
    state["logprobs"].index_copy_(1, slot + 1, logprob[:, None])
    finished.logical_or_(torch.isin(token, eos_ids))
    state["next"].copy_(token)
    slot.add_(1)
