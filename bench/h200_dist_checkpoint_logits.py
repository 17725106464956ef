"""HF -> megatron-core torch_dist (`grpo_pipeline.checkpoints.convert.hf_to_dist`) at a real model size: the
checkpoint loads strictly into megatron-core's GPTModel (local layer spec, TP=PP=1), whose logits are
compared with the HF model's, in bf16 and in fp32 (fp32's near-zero difference is the yardstick
against which bf16's rounding noise is read).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python bench/h200_dist_checkpoint_logits.py --model-shape tiny --out /tmp/r
    python3 bench/h200_dist_checkpoint_logits.py --out $OUT        # one GPU, Qwen3-1.7B's shape

Random weights (shape is what matters): built with Qwen3Config + from_config, saved in bf16 to a
scratch folder. Writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from grpo_pipeline.checkpoints.dist_writer import cpu_megatron
from grpo_pipeline.checkpoints.megatron_layout import hf_to_dist

SHAPES = {
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960},
    "tiny": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 256},
}
BATCH, SEQ = 4, 128


def build_hf(shape: str, out: Path, device: str) -> int:
    """A random Qwen3 of `shape`, saved in bf16; returns its parameter count (tied embedding once)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # HF initialises norms to one: random ones make a swapped norm visible
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def gpt_model(config, dtype: torch.dtype, device: str):
    """megatron-core's GPTModel for an HF Qwen3 config, as tests/e2e/test_dist_checkpoint.py builds it,
    in `dtype`. Weights are not initialised (perform_initialization=False): the checkpoint overwrites them."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    transformer = TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads, ffn_hidden_size=config.intermediate_size, kv_channels=config.head_dim,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        qk_layernorm=True, layernorm_epsilon=config.rms_norm_eps, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=transformer, transformer_layer_spec=spec, vocab_size=config.vocab_size,
                     max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=config.rope_parameters["rope_theta"],
                     share_embeddings_and_output_weights=config.tie_word_embeddings)
    # The local spec's torch norms ignore params_dtype (fp32 weights); cast everything to `dtype`, as
    # megatron-core's Float16Module does in training, so bf16 means bf16 throughout, as in HF's model.
    return model.to(device=device, dtype=dtype).eval()


def load_dist(model, path: Path) -> None:
    """The strict load the converter promises: every key of the model's sharded state dict, no more."""
    from megatron.core import dist_checkpointing

    with cpu_megatron():
        state = dist_checkpointing.load(model.sharded_state_dict(), str(path), strict="raise_all")
    model.load_state_dict(state, strict=True)


def gpt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    batch, seq = tokens.shape
    positions = torch.arange(seq, device=tokens.device)[None].expand(batch, -1)
    # An explicit causal mask (True = masked): megatron-core's default one is built on CUDA.
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    with torch.no_grad(), cpu_megatron():
        return model(tokens, positions, mask).float()


def hf_logits(model_dir: Path, dtype: torch.dtype, device: str, tokens: torch.Tensor) -> tuple[torch.Tensor, str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return logits, model.config._attn_implementation


def compare(ours: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (ours - reference).abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "max_abs_logit": reference.abs().max().item(),
            "top1_agreement": (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()}


def setup_megatron(device: str) -> None:
    """One process group of one rank (an in-process store: no port), TP=PP=1, and an RNG tracker
    (the CUDA one on a GPU; its inference form on CPU, whose training form needs CUDA RNG states)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        random.model_parallel_cuda_manual_seed(0)
    else:
        random.initialize_rng_tracker(inference_rng_tracker=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new one under /tmp)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must be real fp32, or its yardstick is TF32 noise
    torch.backends.cudnn.allow_tf32 = False
    work = args.work or Path(tempfile.mkdtemp(prefix="dist-ckpt-", dir="/tmp"))
    hf_dir, dist_dir = work / "hf", work / "dist"

    params = build_hf(args.model_shape, hf_dir, device)
    start = time.perf_counter()
    hf_to_dist(hf_dir, dist_dir)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in dist_dir.rglob("*") if f.is_file())

    setup_megatron(device)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = gpt_model(config, dtype, device)
        load_start = time.perf_counter()
        load_dist(model, dist_dir)  # the bf16 checkpoint into an fp32 model too: the load upcasts
        load_seconds = time.perf_counter() - load_start
        ours = gpt_logits(model, tokens)
        del model
        reference, attention = hf_logits(hf_dir, dtype, device, tokens)
        results[name] = {**compare(ours, reference), "load_seconds": round(load_seconds, 2)}
        results[f"{name}_hf"] = reference
    # How far HF's own bf16 run is from its fp32 run: the scale of bf16 rounding alone.
    hf_bf16_vs_fp32 = compare(results.pop("bf16_hf"), results.pop("fp32_hf"))

    try:
        import megatron.core
        mcore_version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        mcore_version = megatron.core.__version__
    import transformers

    report = {
        "model_shape": args.model_shape, "config": SHAPES[args.model_shape], "params": params,
        "tokens": [BATCH, SEQ], "hf_attn_implementation": attention,
        "conversion_seconds": round(seconds, 2), "checkpoint_gb": round(size / 1e9, 3),
        "bf16": results["bf16"], "fp32": results["fp32"], "hf_bf16_vs_hf_fp32": hf_bf16_vs_fp32,
        "torch": torch.__version__, "transformers": transformers.__version__, "megatron_core": mcore_version,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "command": " ".join(sys.argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
