"""Peak device memory of real FSDP2 actor updates and log-prob passes, set up the way verl 0.9.1's FSDP
engine sets them up, beside the memory planner's figures for the same layout (planner/fsdp.py).

One measurement = one fresh child process (the allocator's state never leaks between configs): a
transformers `Qwen3ForCausalLM` with random weights in fp32 (verl's `fsdp_config.model_dtype`), every
decoder layer and the untied embedding `fully_shard`ed as units, then the root, with
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` and `reshard_after_forward=True` (verl's
`apply_fsdp2`); gradient checkpointing as verl turns it on (non-reentrant); torch AdamW (foreach, as
verl builds it). A micro batch is `micro_batch` sequences of `seq_len` tokens. The update: bf16 logits,
per-token log-probs by a row-chunked log-softmax (verl's path without flash-attn keeps no fp32 copy of
the logits), a policy-gradient loss, backward, the optimizer step; measured over steps 2..n (Adam's
state exists from step 1 on). The log-prob pass: a no-grad forward of `log_prob_micro_batch` sequences
with log-probs and the entropy (verl always computes the old policy's), beside the state the actor keeps.
All GPU numbers are `torch.cuda.max_memory_allocated`, what the planner estimates.

On the lent H200 (one GPU: a group of one rank; torchrun for more), after `pip install transformers`:

    python3 bench/fsdp_memory_probe.py --out $OUT/results-h200-fsdp-memory.json          # RUNS, one child each
    python3 bench/fsdp_memory_probe.py --only qwen3-1.7b --out $OUT/fsdp-1.7b.json
    torchrun --nproc-per-node 8 bench/fsdp_memory_probe.py --one '{"shape": "qwen3-8b", "micro_batch": 2, "seq_len": 4096}'

On a CPU (gloo, world size 1; the code path runs, nothing is measured: peaks are null):

    .venv/bin/python bench/fsdp_memory_probe.py --device cpu --smoke --out /tmp/fsdp-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

# Qwen3 shapes (config.json of the Qwen3 releases): vocab 151936, head_dim 128, q/k RMSNorm.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {"num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {"num_hidden_layers": 28, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {"num_hidden_layers": 36, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {"num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": False},
    # CPU smoke: the same code, a few MB
    "qwen3-tiny": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": 512, "head_dim": 16},
}
COMMON = {"vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
          "max_position_embeddings": 40960}
# The layouts measured on one H200: micro batch x sequence length, with and without checkpointing.
RUNS: list[dict] = [
    {"shape": "qwen3-0.6b", "micro_batch": 2, "seq_len": 2048, "checkpointing": False},
    {"shape": "qwen3-0.6b", "micro_batch": 4, "seq_len": 4096, "checkpointing": True},
    {"shape": "qwen3-1.7b", "micro_batch": 2, "seq_len": 4096, "checkpointing": True},
    {"shape": "qwen3-1.7b", "micro_batch": 1, "seq_len": 4096, "checkpointing": False},
    {"shape": "qwen3-4b", "micro_batch": 2, "seq_len": 4096, "checkpointing": True},
    {"shape": "qwen3-4b", "micro_batch": 1, "seq_len": 8192, "checkpointing": True},
    {"shape": "qwen3-8b", "micro_batch": 1, "seq_len": 4096, "checkpointing": True},
]
SMOKE: list[dict] = [
    {"shape": "qwen3-tiny", "micro_batch": 2, "seq_len": 64, "checkpointing": True, "steps": 2},
    {"shape": "qwen3-tiny", "micro_batch": 1, "seq_len": 128, "checkpointing": False, "steps": 2},
]
LOG_SOFTMAX_ROWS = 1024  # rows of the logits a log-softmax takes at a time (no fp32 copy of the whole)


def full_config(config: dict) -> dict:
    out = {"steps": 3, "checkpointing": True, "log_prob_micro_batch": config.get("micro_batch", 1), "device": "cuda",
           "entropy_coeff": 0.0, **config}
    out["model"] = {**COMMON, **SHAPES[out["shape"]]}
    return out


def run_name(config: dict) -> str:
    return (f"{config['shape']} mb{config['micro_batch']} x {config['seq_len']} "
            f"ckpt-{'on' if config.get('checkpointing', True) else 'off'}")


def _init_distributed(device: str) -> tuple[int, int]:
    import torch.distributed as dist

    if "RANK" not in os.environ:  # a child of this script: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def build_model(cfg: dict, device: str):
    """The actor as verl's FSDP engine builds it (fp32 parameters, FSDP2 units, mixed precision)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import torch.distributed as dist

    config = Qwen3Config(**cfg["model"], attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.float32)
    if cfg["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    kwargs = {"mesh": mesh, "reshard_after_forward": True,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)}
    units = list(model.model.layers)
    if not config.tie_word_embeddings:
        units.append(model.model.embed_tokens)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def token_log_probs(logits, labels, inplace_backward=True):
    """Log-probs of `labels` from bf16 logits as verl takes them (utils/torch_functional.py:73-107):
    flash-attn's Triton cross entropy where installed (the gradient written into the logits when no
    entropy is computed, as the planner assumes), else a chunk of rows at a time (verl's fallback)."""
    import torch

    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError:
        cross_entropy_loss = None
    if cross_entropy_loss is not None and logits.is_cuda:
        losses = cross_entropy_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                    inplace_backward=inplace_backward)[0]
        return (-losses).view(labels.shape)
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    parts = [torch.log_softmax(flat[i:i + LOG_SOFTMAX_ROWS].float(), dim=-1)
             .gather(-1, flat_labels[i:i + LOG_SOFTMAX_ROWS, None]).squeeze(-1)
             for i in range(0, flat.shape[0], LOG_SOFTMAX_ROWS)]
    return torch.cat(parts).view(labels.shape)


def entropy(logits):
    """verl's entropy_from_logits: logsumexp - sum(softmax * logits), over the whole tensor."""
    import torch

    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def measure(config: dict) -> dict:
    import torch

    cfg = full_config(config)
    device = cfg["device"]
    rank, world = _init_distributed(device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    generator = torch.Generator(device="cpu").manual_seed(0)
    model = build_model(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    vocab = cfg["model"]["vocab_size"]

    def batch(sequences: int):
        ids = torch.randint(0, vocab, (sequences, cfg["seq_len"] + 1), generator=generator).to(device)
        return ids[:, :-1], ids[:, 1:]

    def peak_reset():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak():
        if not cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    allocated = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: None)
    after_model = allocated()
    step_peaks, step_seconds = [], []
    model.train()
    for step in range(cfg["steps"]):
        inputs, labels = batch(cfg["micro_batch"])
        peak_reset()
        started = time.perf_counter()
        logits = model(input_ids=inputs).logits
        log_probs = token_log_probs(logits, labels, inplace_backward=not cfg["entropy_coeff"])
        loss = -(log_probs * torch.randn(log_probs.shape, generator=generator).to(device)).mean()
        if cfg["entropy_coeff"]:
            loss = loss - cfg["entropy_coeff"] * entropy(logits).mean()
        loss.backward()
        del logits, log_probs, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # verl frees the gradients after each step
        step_seconds.append(time.perf_counter() - started)
        if step >= 1:
            step_peaks.append(peak())
    after_steps = allocated()
    model.eval()
    inputs, labels = batch(cfg["log_prob_micro_batch"])
    peak_reset()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
        token_log_probs(logits, labels), entropy(logits)
        del logits
    log_prob_peak = peak()
    measured_steps = [p for p in step_peaks if p is not None]
    result = {"config": cfg, "name": run_name(cfg), "world_size": world, "device": device,
              "torch": torch.__version__, "allocated_after_model": after_model, "allocated_after_steps": after_steps,
              "update_peak": max(measured_steps) if measured_steps else None, "log_prob_peak": log_prob_peak,
              "step_seconds": step_seconds}
    import torch.distributed as dist

    dist.destroy_process_group()
    return result if rank == 0 else {}


def planned(config: dict, world: int = 1) -> dict:
    """The planner's update and old-policy log-prob figures for the config (planner/fsdp.py)."""
    sys.path.insert(0, str(ROOT))
    from grpo_pipeline.planner.memory import estimate
    from grpo_pipeline.profiles.loader import resolve_run_profile

    cfg = full_config(config)
    m = cfg["model"]
    architecture = {"num_layers": m["num_hidden_layers"], "hidden_size": m["hidden_size"],
                    "intermediate_size": m["intermediate_size"], "num_attention_heads": m["num_attention_heads"],
                    "num_kv_heads": m["num_key_value_heads"], "head_dim": m["head_dim"], "vocab_size": m["vocab_size"],
                    "tie_word_embeddings": m["tie_word_embeddings"], "qk_norm": True, "model_type": "qwen3",
                    "hf_architecture": "Qwen3ForCausalLM", "num_experts": 0}
    sequences = cfg["micro_batch"] * world
    overrides = {
        "model": {"architecture": architecture, "enable_gradient_checkpointing": cfg["checkpointing"]},
        "engine": {"strategy": "fsdp"}, "cluster": {"nnodes": 1, "devices_per_node": world},
        "platform": {"accelerator": "H200"}, "rollout": {"tp": 1},
        # one micro batch a rank, all of it response (the prompt's length does not change the tokens)
        "data": {"train_batch_size": sequences, "max_prompt_length": 1, "max_response_length": cfg["seq_len"] - 1},
        "algorithm": {"rollout_n": 1, "use_kl_loss": False, "entropy_coeff": cfg["entropy_coeff"]},
        "actor": {"ppo_mini_batch_size": sequences, "ppo_micro_batch_size_per_gpu": cfg["micro_batch"],
                  "use_dynamic_bsz": False},
        "log_prob": {"micro_batch_size_per_gpu": cfg["log_prob_micro_batch"], "use_dynamic_bsz": False},
    }
    profile, _ = resolve_run_profile("tiny", "gpu", "verl", overrides=overrides, validate=False)
    plan = estimate(profile)
    update = plan.roles[0]
    log_probs = next(r for r in plan.roles if r.when.startswith("log-probs"))
    # the probe keeps the actor's optimizer on the device (no offload) and frees gradients after each step
    return {"update": update.total, "update_parts": update.parts, "log_prob": log_probs.total,
            "log_prob_parts": log_probs.parts}


def _child(config_json: str) -> None:
    print(json.dumps(measure(json.loads(config_json))), flush=True)


def measure_in_subprocess(config: dict, timeout: float = 900.0) -> dict:
    """One config in a fresh interpreter (a world of one), its result or its failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode:
        return {"config": full_config(config), "name": run_name(full_config(config)),
                "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(result: dict) -> dict:
    """The measurement beside the planner's figures (ratio: planned / measured)."""
    if "error" in result:
        return result
    plan = planned(result["config"], result["world_size"])
    out = {**result, "planned_update": plan["update"], "planned_log_prob": plan["log_prob"],
           "planned_update_parts": plan["update_parts"], "planned_log_prob_parts": plan["log_prob_parts"]}
    for kind in ("update", "log_prob"):
        measured = result[f"{kind}_peak"]
        out[f"{kind}_ratio"] = round(plan[kind] / measured, 3) if measured else None
    return out


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['name']}: FAILED {row['error']}"
    return (f"{row['name']}: update measured {_gib(row['update_peak'])} GiB, planned {_gib(row['planned_update'])} "
            f"(ratio {row['update_ratio']}); log-probs measured {_gib(row['log_prob_peak'])}, planned "
            f"{_gib(row['planned_log_prob'])} (ratio {row['log_prob_ratio']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--one", metavar="JSON", help="measure one config in this process (torchrun: every rank)")
    mode.add_argument("--smoke", action="store_true", help="the tiny configs, one child each")
    mode.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument("--only", action="append", default=[], help="RUNS of this shape only (repeatable)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="write the rows (JSON list) here")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    if args.one:
        result = measure({"device": args.device, **json.loads(args.one)})
        if not result:  # not rank 0
            return 0
        rows = [compare(result)]
    else:
        configs = SMOKE if args.smoke else [r for r in RUNS if not args.only or r["shape"] in args.only]
        rows = [compare(measure_in_subprocess({"device": args.device, **config})) for config in configs]
    for row in rows:
        print(summary_line(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
