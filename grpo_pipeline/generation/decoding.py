"""Native decoding for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral without a sliding
window), gpt-fast style: the generator of the local backend's rollouts and of the evaluation stage.

    python bench/bench_decode_floor.py --device gpu --out $OUT/decode-floor.json   # the H200 matrix
    .venv/bin/python -m pytest -q tests/test_decoding.py                           # CPU: same tokens as generate

A static KV cache; the prompt batch prefilled at once; then one decode step per token
(generation/decode_step.py). On a CUDA GPU the step is torch.compile'd (one compiled layer serves every
layer; FlexAttention reads each sequence's cache only up to its current length) and captured whole in
a CUDA graph: one replay per token. Sampling (temperature, top-k, top-p) happens on the device; end of
sequence is a device-side `finished` mask the host reads every `check_every` steps, so no step waits
for the host. The model's own parameters are read in place (q/k/v and gate/up packed into one matrix
each, re-copied from the model at every `generate`), so a trainer's updates reach the next rollout
(a LoRA policy's adapted layers merged: generation/adapted.py).

On a CPU (tests) and where a feature is missing (an NPU: no CUDA graphs, no inductor) the same step
runs eagerly, with matmul attention; a model this module cannot run is named by `unsupported()`,
and its caller keeps transformers' `generate`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_pipeline.generation.decode_step import (CACHE_BLOCK, Sampling, Shape, Splits, decode_head, decode_layer, decode_prologue,
                                prefill_layer, product_splits, rope_tables)
from grpo_pipeline.generation.adapted import adapter_refusal, base_model_of, merged_weight, weight_for_decoding, write_merged

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables fixed per position, not per sequence length
COMPILE_OPTIONS: dict = {"combo_kernels": True}  # inductor: independent small kernels (a layer's q, its k and v) as one
KV_BLOCK = 64  # FlexAttention reads whole blocks: 64 positions waste less past each step's length than 128
PREFILL_TOKENS = 32768  # prompt tokens prefilled at once (bounds the prefill's activations)


@dataclass
class Generated:
    completions: list[list[int]]  # generated tokens, up to and including the first end-of-sequence
    logprobs: list[list[float]]  # each one's log-probability under softmax(logits / temperature)
    truncated: list[bool]  # no end-of-sequence within max_new_tokens
    prompt_lengths: list[int]  # tokens of each prompt as generated from (after any left truncation)
    prefill_s: float
    decode_s: float
    steps: int  # decode steps after the prefill


def unsupported(model) -> str | None:
    """Why `NativeDecoder` cannot run this model (a PEFT one: its base with the adapter); None when it can."""
    model = base_model_of(model)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (native decoding runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", kind == "mistral"):
        return "sliding-window attention"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"rope type {rope_type!r}"
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "quantization_config", None):
        return "tensor-parallel pretraining slices or quantized weights"
    inner = getattr(model, "model", None)
    if not hasattr(inner, "layers") or not hasattr(getattr(inner, "rotary_emb", None), "inv_freq"):
        return "a module layout other than transformers' Llama family"
    attention = inner.layers[0].self_attn
    if len({getattr(attention, name).bias is None for name in ("q_proj", "k_proj", "v_proj")}) > 1:
        return "biases on some of the q/k/v projections only"
    return adapter_refusal(model)


def compile_cache_dir(model_root: str) -> Path:
    """Where compiled decode steps are kept: beside the models they were compiled for."""
    return Path(model_root).expanduser() / "torch-compile-cache"


def use_compile_cache(directory: Path) -> None:
    """Keep torch's compile caches (inductor's FX graph cache, AOTAutograd's, Triton's kernels) in
    `directory`, so a later run of the same model and shapes on this machine loads its compiled
    decode step instead of compiling it; a directory the user already chose (TORCHINDUCTOR_CACHE_DIR)
    wins."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(directory))


class _Workspace:
    """What a batch of `batch` sequences up to `length` positions decodes in: KV caches, the step's
    state, the block mask, and one captured graph per sampling setting."""

    def __init__(self, decoder: NativeDecoder, batch: int, length: int):
        import torch

        device, dtype, shape = decoder.device, decoder.dtype, decoder.shape
        self.batch, self.length = batch, length
        layers = len(decoder.weights)
        # a layer's keys and values in one tensor (keys first): one kernel writes both each step
        self.kv = [torch.zeros(batch, 2 * shape.kv_heads, length, shape.head_dim, device=device, dtype=dtype)
                   for _ in range(layers)]
        long = dict(device=device, dtype=torch.long)
        self.state = {
            "tokens": torch.zeros(batch, length + 1, **long),
            "logprobs": torch.zeros(batch, length + 1, device=device, dtype=torch.float32),
            "finished": torch.zeros(batch, device=device, dtype=torch.bool),
            "next": torch.zeros(batch, **long),
            "start": torch.zeros(batch, **long),
            "slot": torch.zeros(1, **long),
            "min_slot": torch.zeros(1, **long),
            "pad": torch.full((1,), decoder.pad_token_id, **long),
        }
        self.positions = torch.arange(length, **long)
        self.kv_blocks, self.block_mask = None, None
        if decoder.attention == "flex":
            from torch.nn.attention.flex_attention import BlockMask

            start, slot = self.state["start"], self.state["slot"]

            def visible(b, h, q_idx, kv_idx):
                return (kv_idx >= start[b]) & (kv_idx <= slot[0])

            self.kv_blocks = torch.ones(1, 1, 1, device=device, dtype=torch.int32)
            blocks = torch.arange(length // decoder.kv_block, device=device, dtype=torch.int32).view(1, 1, 1, -1)
            self.block_mask = BlockMask.from_kv_blocks(self.kv_blocks, blocks, BLOCK_SIZE=decoder.kv_block,
                                                       mask_mod=visible, seq_lengths=(1, length))
        self.splits = decoder.splits_for(batch)
        self.graphs: dict[Sampling, object] = {}
        self.pool = None


class NativeDecoder:
    """Generates for one model; reuse it across batches (its cache, compiled step and graphs stay)."""

    def __init__(self, model, eos_token_ids: list[int], pad_token_id: int, *, compile: bool | None = None,
                 cuda_graphs: bool | None = None, attention: str | None = None, check_every: int = 32,
                 compile_options: dict | None = None, splits: Splits | None = None, kv_block: int = KV_BLOCK,
                 flex_options: dict | None = None):
        import torch

        if reason := unsupported(model):
            raise ValueError(f"native decoding cannot run this model: {reason}")
        self.model = model = base_model_of(model)  # a PEFT model's base: its adapted layers are PEFT's
        self.check_every = check_every
        self.eos_token_ids, self.pad_token_id = [int(t) for t in eos_token_ids], int(pad_token_id)
        embed = model.model.embed_tokens.weight
        self.device, self.dtype, self.vocab = embed.device, embed.dtype, model.lm_head.weight.shape[0]
        cuda = self.device.type == "cuda"
        self.compiled = cuda if compile is None else compile
        self.cuda_graphs = cuda and cuda_graphs is not False
        flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
        self.attention = attention or ("flex" if self.compiled and flex else "matmul")
        config, first = model.config, model.model.layers[0]
        heads = config.num_attention_heads
        self.shape = Shape(hidden=config.hidden_size, heads=heads, kv_heads=config.num_key_value_heads,
                           head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                           eps=config.rms_norm_eps, qk_norm=hasattr(first.self_attn, "q_norm"))
        if kv_block <= 0 or CACHE_BLOCK % kv_block:
            raise ValueError(f"kv_block={kv_block}: FlexAttention's block must divide the cache's {CACHE_BLOCK}")
        self.kv_block, self.flex_options = kv_block, flex_options
        self._splits = splits  # None: product_splits picks per batch on a GPU
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.weights = [self._layer_weights(layer) for layer in model.model.layers]
        self.eos_ids = torch.tensor([t for t in self.eos_token_ids if t < self.vocab] or [-1], device=self.device)
        options = {**COMPILE_OPTIONS, **(compile_options or {})}
        compile_step = ((lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, options=options))
                        if self.compiled else (lambda fn: fn))
        self._prologue, self._layer, self._head = map(compile_step, (decode_prologue, decode_layer, decode_head))
        self._workspace: _Workspace | None = None
        self._pointers: tuple = ()
        self.notes: list[str] = []  # fallbacks taken, for describe()

    def splits_for(self, batch: int) -> Splits:
        """How the decode step of `batch` sequences splits its products: as given, else on a CUDA GPU
        by `product_splits` (elsewhere the products stay whole: the split pays only on a GPU)."""
        if self._splits is not None:
            return self._splits
        if not (self.compiled and self.device.type == "cuda"):
            return Splits()
        shape = self.shape
        return product_splits(shape.hidden, shape.heads * shape.head_dim, 2 * shape.kv_heads * shape.head_dim,
                              self.model.config.intermediate_size, batch)

    def describe(self) -> str:
        step = "compiled" if self.compiled else "eager"
        graphs = " captured in a CUDA graph" if self.cuda_graphs else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return f"native decoding ({step} step{graphs}, {self.attention} attention, static KV cache, sampling on the device{notes})"

    def _layer_weights(self, layer) -> dict:
        import torch

        attn, mlp = layer.self_attn, layer.mlp
        pack = lambda *ws: torch.empty(sum(w.shape[0] for w in ws), *ws[0].shape[1:], device=self.device, dtype=ws[0].dtype)
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        return {
            "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": pack(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
            "qkv_bias": pack(*biases) if all(b is not None for b in biases) else None,
            "q_norm": attn.q_norm.weight if self.shape.qk_norm else None,
            "k_norm": attn.k_norm.weight if self.shape.qk_norm else None,
            "o": weight_for_decoding(attn.o_proj, self.device, self.dtype), "o_bias": attn.o_proj.bias,
            "gate_up": pack(mlp.gate_proj.weight, mlp.up_proj.weight),
            "down": weight_for_decoding(mlp.down_proj, self.device, self.dtype),
        }

    def _refresh_weights(self) -> None:
        """The weight sync: the model's current q/k/v and gate/up into the packed matrices, an adapted o/down
        merged into its copy (a trainer updates them in place); the captured graphs read the same addresses."""
        import torch

        for layer, w in zip(self.model.model.layers, self.weights):
            attn, mlp = layer.self_attn, layer.mlp
            torch.cat([merged_weight(attn.q_proj), merged_weight(attn.k_proj), merged_weight(attn.v_proj)], out=w["qkv"])
            if w["qkv_bias"] is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], out=w["qkv_bias"])
            torch.cat([merged_weight(mlp.gate_proj), merged_weight(mlp.up_proj)], out=w["gate_up"])
            write_merged(attn.o_proj, w["o"])
            write_merged(mlp.down_proj, w["down"])
        inner = self.model.model
        read = [t for w in self.weights for t in w.values() if t is not None]
        pointers = tuple(t.data_ptr() for t in read + [inner.embed_tokens.weight, inner.norm.weight,
                                                       inner.rotary_emb.inv_freq, self.model.lm_head.weight])
        if pointers != self._pointers and self._workspace is not None:
            self._workspace.graphs.clear()  # a parameter moved: graphs captured on the old one are stale
        self._pointers = pointers

    def reserve(self, batch: int, length: int) -> None:
        """Size the cache for `batch` sequences of `length` positions (prompt + new tokens) now, so
        later batches up to that size reuse one compiled step and graph."""
        self._workspace_for(batch, length)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 max_prompt_tokens: int | None = None) -> Generated:
        """Up to `max_new_tokens` tokens for each prompt (token ids), stopping at end-of-sequence.
        A prompt longer than `max_prompt_tokens`, or than the model's context leaves room for, keeps
        its last tokens (left truncation)."""
        import torch

        if not prompts or max_new_tokens <= 0:
            raise ValueError("generate needs at least one prompt and max_new_tokens >= 1")
        limit = max_prompt_tokens or math.inf
        if self.max_positions:
            limit = min(limit, self.max_positions - max_new_tokens)
        if limit < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                             f"{self.max_positions} positions")
        prompts = [list(p[-int(limit):]) if len(p) > limit else list(p) for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt: every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        # one compiled step per model shape and batch: more than dynamo's default 8 in a process that
        # decodes for several models (the bench)
        recompiles = torch._dynamo.config.patch(recompile_limit=64) if self.compiled else contextlib.nullcontext()
        with torch.no_grad(), recompiles:
            workspace, run = self._runner(len(prompts), width + max_new_tokens, sampling)
            started = time.perf_counter()
            self._prefill(workspace, prompts, width, sampling)
            self._sync()
            prefilled = time.perf_counter()
            finished, steps = workspace.state["finished"], 0
            for steps in range(1, max_new_tokens):
                run()
                if steps % self.check_every == 0 and bool(finished.all()):
                    break
            self._sync()
            decoded = time.perf_counter()
            rows = slice(0, len(prompts)), slice(width, width + max_new_tokens)
            tokens = workspace.state["tokens"][rows].tolist()
            logprobs = workspace.state["logprobs"][rows].tolist()
        completions, kept_logprobs, truncated = [], [], []
        for ids, lps in zip(tokens, logprobs):
            end = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), None)
            completions.append(ids if end is None else ids[: end + 1])
            kept_logprobs.append(lps[: len(completions[-1])])
            truncated.append(end is None)
        return Generated(completions, kept_logprobs, truncated, [len(p) for p in prompts],
                         prefilled - started, decoded - prefilled, steps)

    def _runner(self, batch: int, length: int, sampling: Sampling):
        """The workspace and the decode step as one callable: a graph replay where CUDA graphs are on.
        Where capturing fails (a feature this torch or device lacks), the next simpler step is tried,
        split products -> whole ones, FlexAttention -> matmul attention -> no CUDA graph, and the reason
        is kept in `notes`."""
        workspace = self._workspace_for(batch, length)
        self._refresh_weights()
        if not self.cuda_graphs:
            return workspace, lambda: self._step(workspace, sampling)
        try:
            return workspace, self._graph(workspace, sampling)
        except Exception as error:  # noqa: BLE001 - any failure to compile or capture has the same remedy
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
            if workspace.splits != Splits():
                self._splits = Splits()
                self.notes.append(f"split products failed ({reason}); whole products instead")
            elif self.attention == "flex":
                self.attention = "matmul"
                self.notes.append(f"FlexAttention step failed ({reason}); matmul attention instead")
            else:
                self.cuda_graphs = False
                self.notes.append(f"CUDA graph capture failed ({reason}); step without a graph")
            self._workspace = None
            return self._runner(batch, length, sampling)

    def _workspace_for(self, batch: int, length: int) -> _Workspace:
        """The current workspace when it holds `batch` sequences of `length` positions (a smaller batch
        is padded with finished rows), else a new one: the old one is freed first."""
        length = CACHE_BLOCK * math.ceil(length / CACHE_BLOCK)  # so also a multiple of kv_block
        current = self._workspace
        if current is None or batch > current.batch or length > current.length:
            self._workspace = None
            if current is not None and self.device.type == "cuda":
                del current
                import torch

                torch.cuda.empty_cache()
            self._workspace = _Workspace(self, batch, length)
        return self._workspace

    def _prefill(self, ws: _Workspace, prompts: list[list[int]], width: int, sampling: Sampling) -> None:
        """All prompts, left-padded to `width`, through every layer (their keys and values into the
        cache), then the first token; rows beyond the prompts are padding, finished from the start."""
        import torch

        rows = ws.batch
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
        state, device = ws.state, self.device
        starts = torch.tensor([width - len(p) for p in prompts] + [width - 1] * (rows - len(prompts)))
        state["start"].copy_(starts)
        state["finished"].copy_(torch.arange(rows) >= len(prompts))
        state["slot"].fill_(width - 1)
        state["min_slot"].fill_(width - 1 + sampling.min_new_tokens)
        ids, starts = ids.to(device), starts.to(device)
        embed, rotary = self.model.model.embed_tokens.weight, self.model.model.rotary_emb
        positions = torch.arange(width, device=device)
        last = []
        for first in range(0, rows, max(1, PREFILL_TOKENS // width)):
            chunk = slice(first, min(rows, first + max(1, PREFILL_TOKENS // width)))
            start = starts[chunk, None]
            rope = rope_tables((positions - start).clamp(min=0), rotary.inv_freq, rotary.attention_scaling, self.dtype)
            # causal, without the left padding; a padding position sees itself so no row is all -inf
            mask = ((positions[None, None, :] <= positions[None, :, None]) & (positions[None, None, :] >= start[:, :, None])) \
                | (positions[None, None, :] == positions[None, :, None])
            x = torch.nn.functional.embedding(ids[chunk], embed)
            for w, kv in zip(self.weights, ws.kv):
                x = prefill_layer(x, w, kv[chunk], *rope, mask[:, None], self.shape)
            last.append(x[:, -1])
        last = torch.cat(last).contiguous()
        self._sample(ws, last, torch.zeros_like(last)[None], sampling)

    def _step(self, ws: _Workspace, sampling: Sampling) -> None:
        import torch

        rotary = self.model.model.rotary_emb
        x, cos, sin, visible = self._prologue(ws.state, self.model.model.embed_tokens.weight, rotary.inv_freq,
                                              rotary.attention_scaling, ws.positions, ws.kv_blocks, self.kv_block)
        down = ws.splits.down
        delta = x.new_zeros((down, *x.shape), dtype=torch.float32 if down > 1 else x.dtype)
        for w, kv in zip(self.weights, ws.kv):
            x, delta = self._layer(x, delta, w, kv, cos, sin, ws.state["slot"], visible, ws.block_mask, self.shape,
                                   ws.splits, self.flex_options)
        self._sample(ws, x[:, 0], delta[:, :, 0], sampling)

    def _sample(self, ws: _Workspace, x, delta, sampling: Sampling) -> None:
        self._head(x, delta, self.model.model.norm.weight, self.model.lm_head.weight, ws.state, self.eos_ids,
                   sampling, self.shape.eps)

    def _graph(self, ws: _Workspace, sampling: Sampling):
        """The decode step captured as one CUDA graph (warmed up first on a side stream, so compiling
        and autotuning happen outside the capture); its replay is one launch per token."""
        import torch

        if sampling not in ws.graphs:
            saved = {name: tensor.clone() for name, tensor in ws.state.items()}
            ws.state["slot"].zero_()  # warm-up steps write the cache at slot and slot + 1: keep them inside
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(ws, sampling)
            torch.cuda.current_stream().wait_stream(stream)
            ws.pool = ws.pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=ws.pool):
                self._step(ws, sampling)
            for name, tensor in saved.items():  # the warm-up steps moved the state on
                ws.state[name].copy_(tensor)
            ws.graphs[sampling] = graph
        return ws.graphs[sampling].replay

    def _sync(self) -> None:
        if self.device.type == "cuda":
            __import__("torch").cuda.synchronize()
