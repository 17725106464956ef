"""Peak device memory of real megatron-core training steps, set up the way verl 0.9.1 sets up its
Megatron actor, as ground truth for memory *estimates*.

One measurement = one fresh child process (the allocator's state never leaks between configs):
megatron-core 0.16 `GPTModel` (local layer spec; core attention swapped for a flash/efficient
`scaled_dot_product_attention` module, as production runs flash attention) in bf16, TP=PP=1, wrapped as
verl's `get_model` does (`Float16Module`, then mcore `DistributedDataParallel` with
use_distributed_optimizer, grad_reduce_in_fp32, no overlap) and trained with
`get_megatron_optimizer(adam, distributed)`. Reported: bytes allocated after the model (bf16 params +
fp32 grad buffer), after step 1 (+ optimizer states), the peak over steps 2..n, and the peak of one
no-grad eval forward of the same micro batch (a log-prob pass). All numbers are
`torch.cuda.memory_allocated` / `max_memory_allocated`, i.e. what PyTorch's allocator handed out.

Needs one NVIDIA GPU, torch and megatron-core 0.16 (no TransformerEngine, no apex); it cannot run on
a CPU-only host. On the lent H200 (device tool, `carry: [".whl/mcore"]`):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/mcore/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 bench/megatron_memory_probe.py --smoke --out $OUT/smoke.json     # two tiny configs
    python3 bench/megatron_memory_probe.py --matrix --out $OUT/results.json  # SHAPES x RUNS (default)
    python3 bench/megatron_memory_probe.py --one '{"shape": "qwen3-0.6b", "micro_batch": 1, "seq_len": 2048}'

From another script: `from megatron_memory_probe import SHAPES, RUNS, measure_in_subprocess`;
`measure_in_subprocess({"shape": "qwen3-1.7b", "micro_batch": 2, "seq_len": 2048, "recompute": True})`
(a config may also spell out every shape key instead of naming a shape).

megatron-core 0.16 traps worked around without TE/apex (`_patch_megatron`, `_torch_adamw`): the MoE router's
`te_general_gemm` is never defined when TE is absent (set to None -> torch matmul); the optimizer falls
back to torch.optim.AdamW (mcore's own fallback for apex/TE FusedAdam) built without `fused`/`foreach`,
so torch takes its foreach path, whose step allocates temporaries as large as all fp32 main params
(+4 bytes/param, the peak of most runs); the probe builds it with `fused=True` (torch's fused kernel,
no such temporaries, like FusedAdam) unless a config says `"optimizer_impl": "foreach"`
(`--optimizer-impl foreach` for mcore's fallback as is).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3

# Qwen3 shapes. Common to all: vocab 151936, head_dim 128, q/k RMSNorm (qk_layernorm), rope theta 1e6.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {"num_layers": 28, "hidden_size": 1024, "ffn_hidden_size": 3072, "num_attention_heads": 16,
                   "num_query_groups": 8, "kv_channels": 128, "vocab_size": 151936, "tied": True,
                   "qk_layernorm": True},
    "qwen3-1.7b": {"num_layers": 28, "hidden_size": 2048, "ffn_hidden_size": 6144, "num_attention_heads": 16,
                   "num_query_groups": 8, "kv_channels": 128, "vocab_size": 151936, "tied": True,
                   "qk_layernorm": True},
    "qwen3-4b": {"num_layers": 36, "hidden_size": 2560, "ffn_hidden_size": 9728, "num_attention_heads": 32,
                 "num_query_groups": 8, "kv_channels": 128, "vocab_size": 151936, "tied": True,
                 "qk_layernorm": True},
    # Qwen3-30B-A3B's layer with 4 layers: every layer MoE, no dense FFN, no shared expert.
    "qwen3-moe-4l": {"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 4,
                     "kv_channels": 128, "num_experts": 128, "moe_ffn_hidden_size": 768, "moe_router_topk": 8,
                     "vocab_size": 151936, "tied": False, "qk_layernorm": True},
}


def _runs(shape: str, extra: tuple = ()) -> list[dict]:
    grid = [(1, 2048, False), (2, 2048, True), (4, 1024, False), *extra]
    return [{"shape": shape, "micro_batch": b, "seq_len": s, "recompute": r} for b, s, r in grid]


RUNS: list[dict] = [
    *_runs("qwen3-0.6b"),
    *_runs("qwen3-1.7b", ((1, 4096, True),)),
    *_runs("qwen3-4b"),
    *_runs("qwen3-moe-4l"),
]

# Tiny shapes for a first shake-out call (`--smoke`); not part of SHAPES.
SMOKE_RUNS: list[dict] = [
    {"name": "tiny-dense", "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
     "num_query_groups": 2, "kv_channels": 64, "vocab_size": 1024, "tied": True, "qk_layernorm": True,
     "micro_batch": 2, "seq_len": 256, "recompute": False},
    {"name": "tiny-moe", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
     "kv_channels": 64, "num_experts": 8, "moe_ffn_hidden_size": 128, "moe_router_topk": 2, "vocab_size": 1024,
     "tied": False, "qk_layernorm": True, "micro_batch": 2, "seq_len": 256, "recompute": True},
]


def run_name(config: dict) -> str:
    if config.get("name"):
        return config["name"] + ("-foreach" if config.get("optimizer_impl") == "foreach"
                                 and not config["name"].endswith("-foreach") else "")
    rc = "rc" if config.get("recompute") else "norc"
    impl = "-foreach" if config.get("optimizer_impl") == "foreach" else ""
    return f"{config.get('shape', 'custom')}/mb{config['micro_batch']}-s{config['seq_len']}-{rc}{impl}"


def full_config(config: dict) -> dict:
    """`config` with its named shape's keys filled in (its own keys win) and defaults applied."""
    out = {**SHAPES.get(config.get("shape", ""), {}), **config}
    out.setdefault("recompute", False)
    out.setdefault("steps", 3)
    out.setdefault("tied", False)
    out.setdefault("qk_layernorm", False)
    out.setdefault("optimizer_impl", "fused")
    out["name"] = run_name(out)
    return out


# ------------------------------------------------------------------------------------------ child side


def _patch_megatron() -> list[str]:
    """Minimal fixes for megatron-core 0.16 without TransformerEngine. Returns what was patched."""
    patched = []
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # The router's gemm checks `te_general_gemm is not None`, but the TE import guard only defines the
    # name when TE imports: NameError without TE. None -> the router falls back to torch.matmul.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        patched.append("moe_utils.te_general_gemm=None")
    return patched


def _sdpa_core_attention_class():
    """A core-attention module with mcore 0.16 DotProductAttention's constructor and forward signature
    (q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads*d]) that runs torch's flash/efficient
    SDPA kernel: no s x s score matrix (mcore's local DotProductAttention materialises one)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                     softmax_scale=None, pg_collection=None, **kwargs):
            super().__init__(config=config)
            assert attn_mask_type == AttnMaskType.causal, attn_mask_type
            self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as mcore's default

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert attention_bias is None and packed_seq_params is None
            s, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            # Never the math kernel: it would materialise the scores and falsify the measurement.
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=True)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


@contextlib.contextmanager
def _torch_adamw(impl: str):
    """Which torch AdamW mcore's no-TE/no-apex fallback builds (it calls `torch.optim.AdamW(...)` with
    neither `fused` nor `foreach`, so torch picks foreach on CUDA, whose temporaries are as large as
    all fp32 main params together: +4 bytes/param at the optimizer step, which TE/apex FusedAdam, the
    production optimizer, does not allocate).
    "fused": torch's fused AdamW kernel, the FusedAdam stand-in (default); "foreach": mcore's fallback
    as is."""
    import torch

    if impl == "foreach":
        yield
        return
    if impl != "fused":
        raise ValueError(f"optimizer_impl must be 'fused' or 'foreach', not {impl!r}")
    original = torch.optim.AdamW

    class FusedAdamW(original):
        def __init__(self, params, **kwargs):
            kwargs.setdefault("fused", True)
            super().__init__(params, **kwargs)

    torch.optim.AdamW = FusedAdamW
    try:
        yield
    finally:
        torch.optim.AdamW = original


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_distributed() -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", world_size=1, rank=0,
                                         init_method=f"tcp://127.0.0.1:{_free_port()}")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def build_gpt(cfg: dict, cpu: bool = False):
    """megatron-core GPTModel for `cfg` (local spec + SDPA core attention), as verl's Qwen3 converters
    configure it. `cpu=True` only for a CPU shake-out of the construction code (not a measurement)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = bool(cfg.get("num_experts"))
    kwargs = dict(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_query_groups"],
        kv_channels=cfg["kv_channels"], ffn_hidden_size=cfg.get("ffn_hidden_size") or cfg.get("moe_ffn_hidden_size"),
        qk_layernorm=cfg["qk_layernorm"], layernorm_epsilon=1e-6, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=cpu,
    )
    if moe:
        kwargs.update(
            num_moe_experts=cfg["num_experts"], moe_ffn_hidden_size=cfg["moe_ffn_hidden_size"],
            moe_router_topk=cfg["moe_router_topk"], moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none", moe_router_score_function="softmax",
            moe_router_pre_softmax=False, moe_grouped_gemm=False,
        )
    if cfg["recompute"]:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tconfig = TransformerConfig(**kwargs)

    spec = get_gpt_layer_local_spec(num_experts=cfg["num_experts"] if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=cfg["qk_layernorm"], normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention_class()
    model = GPTModel(config=tconfig, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"],
                     max_sequence_length=40960, pre_process=True, post_process=True, parallel_output=True,
                     share_embeddings_and_output_weights=cfg["tied"], position_embedding_type="rope",
                     rotary_base=1_000_000)
    return tconfig, model


def measure(config: dict) -> dict:
    """One measurement in THIS process (call it in a fresh process: `measure_in_subprocess`)."""
    import torch
    import megatron.core
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    cfg = full_config(config)
    result: dict = {"name": cfg["name"], "config": cfg, "torch": torch.__version__,
                    "megatron_core": megatron.core.__version__, "gpu": torch.cuda.get_device_name(0)}
    result["patched"] = _patch_megatron()
    _init_distributed()

    # verl.utils.megatron_utils.get_model: build, default TP attributes, to GPU, Float16Module, DDP.
    tconfig, gpt = build_gpt(cfg)
    for param in gpt.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    result["parameters"] = sum(p.numel() for p in gpt.parameters())  # a tied weight is one Parameter
    gpt.cuda()
    model = DistributedDataParallel(
        config=tconfig, module=Float16Module(tconfig, gpt),
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=False))
    model.broadcast_params()
    torch.cuda.synchronize()
    result["after_model_bytes"] = torch.cuda.memory_allocated()

    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-6, bf16=True, use_distributed_optimizer=True,
                                       clip_grad=1.0, weight_decay=0.01)
    with _torch_adamw(cfg["optimizer_impl"]):
        optimizer = get_megatron_optimizer(optimizer_config, [model])
    inner = getattr(optimizer, "chained_optimizers", [optimizer])  # one per param kind (dense / expert)
    result["optimizer"] = f"{type(optimizer).__name__}[" + ", ".join(
        f"{type(o).__name__}({type(o.optimizer).__module__}.{type(o.optimizer).__name__}"
        f" fused={o.optimizer.defaults.get('fused')} foreach={o.optimizer.defaults.get('foreach')})"
        for o in inner) + "]"

    b, s, vocab = cfg["micro_batch"], cfg["seq_len"], cfg["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, vocab, (b, s), device="cuda", generator=gen)
    labels = torch.randint(0, vocab, (b, s), device="cuda", generator=gen)
    position_ids = torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(input_ids, position_ids, None, labels=labels)  # per-token loss [b, s], fp32
        loss.mean().backward()
        model.finish_grad_sync()  # what finalize_model_grads does with overlap_grad_reduce=False
        update_ok, _, _ = optimizer.step()
        assert update_ok, "optimizer step skipped"
        del loss
        torch.cuda.synchronize()
        return time.perf_counter() - start

    model.train()
    result["step1_seconds"] = step()
    result["after_optimizer_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(cfg["steps"] - 1)]
    result["peak_step_bytes"] = torch.cuda.max_memory_allocated()
    result["peak_step_reserved_bytes"] = torch.cuda.max_memory_reserved()
    result["step_seconds"] = sum(times) / len(times) if times else result["step1_seconds"]

    model.eval()
    torch.cuda.synchronize()
    result["forward_only_base_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = model(input_ids, position_ids, None, labels=labels)
        torch.cuda.synchronize()
    result["forward_only_peak_bytes"] = torch.cuda.max_memory_allocated()
    del out
    result["total_gpu_bytes"] = torch.cuda.get_device_properties(0).total_memory
    torch.distributed.destroy_process_group()
    return result


def _child(config_json: str) -> None:
    config = json.loads(config_json)
    try:
        result = measure(config)
    except BaseException as exc:  # noqa: BLE001 - the parent must keep going
        import traceback

        traceback.print_exc()
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        result = {"name": run_name(full_config(config)), "config": full_config(config),
                  "error": f"{type(exc).__name__}: {lines[-1] if lines else ''}".strip()}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (NCCL/gloo destructors)


# ----------------------------------------------------------------------------------------- parent side


def measure_in_subprocess(config: dict, timeout: float = 300.0) -> dict:
    """`measure(config)` in a fresh `python3 <this file> --one '<json>'`; always returns a dict (with
    `error` on failure, a crash or a timeout)."""
    cfg = full_config(config)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": cfg["name"], "config": cfg, "error": f"timeout after {timeout:.0f} s"}
    tail = [line for line in proc.stderr.splitlines() if line.strip()]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                break
            if "error" in result:
                result["stderr_tail"] = tail[-30:]
            return result
    return {"name": cfg["name"], "config": cfg, "stderr_tail": tail[-30:],
            "error": f"child exited {proc.returncode}: {tail[-1] if tail else 'no output'}"}


def _gib(value) -> str:
    return f"{value / GIB:7.2f}" if isinstance(value, (int, float)) else "      -"


def summary_line(result: dict) -> str:
    if "error" in result:
        return f"{result['name']:<32} ERROR {result['error']}"
    return (f"{result['name']:<32} params {result['parameters'] / 1e9:6.3f}B  model {_gib(result['after_model_bytes'])}"
            f"  +optim {_gib(result['after_optimizer_bytes'])}  peak {_gib(result['peak_step_bytes'])}"
            f"  fwd-only {_gib(result['forward_only_peak_bytes'])} GiB  step {result['step_seconds']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--one", metavar="JSON", help="measure one config in this process; print one JSON line")
    mode.add_argument("--matrix", action="store_true", help="every entry of RUNS, one child each (default)")
    mode.add_argument("--smoke", action="store_true", help="two tiny configs, one child each")
    parser.add_argument("--only", action="append", default=[],
                        help="with --matrix: only runs whose name contains this (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="override every run's steps (default 3)")
    parser.add_argument("--optimizer-impl", choices=["fused", "foreach"],
                        help="override every run's optimizer_impl (default fused; see _torch_adamw)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    parser.add_argument("--out", type=Path, help="write the results (JSON list) here")
    args = parser.parse_args(argv)

    if args.one is not None:
        _child(args.one)
        return 0

    runs = SMOKE_RUNS if args.smoke else [r for r in RUNS if not args.only
                                          or any(key in run_name(r) for key in args.only)]
    results = []
    start = time.time()
    for run in runs:
        config = dict(run, **({"steps": args.steps} if args.steps else {}),
                      **({"optimizer_impl": args.optimizer_impl} if args.optimizer_impl else {}))
        t0 = time.time()
        result = measure_in_subprocess(config, timeout=args.timeout)
        result["wall_seconds"] = round(time.time() - t0, 1)
        results.append(result)
        print(summary_line(result) + f"  ({result['wall_seconds']:.0f} s)", flush=True)
        if args.out:  # rewrite after every run: a later crash or timeout keeps what was measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{len(results)} runs, {sum('error' in r for r in results)} failed, {time.time() - start:.0f} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
