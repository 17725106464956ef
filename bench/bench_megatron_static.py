"""The planner's static memory (bf16 weights, fp32 gradients, Adam's state under the distributed
optimizer) against Megatron-LM's own estimator, layout by layout, side by side.

    .venv/bin/python bench/bench_megatron_static.py

Megatron-LM's `compute_weight_and_optimizer_memory` (megatron/training/theoretical_memory_usage.py),
transcribed below in two versions:
- core_v0.16.1 (55ac7082, lines 12-189; the megatron-core verl 0.9.1 runs): parameters of the most
  loaded shard = (transformer block / PP + MTP block + embedding) / TP (+ the output layer at PP 1 when
  untied), times 18 bytes, or 6 + 12 / DP with the distributed optimizer. Routed experts are divided by
  TP only: it has no expert parallelism, and no router, q/k-norm or bias parameters.
- main (d98e8a64, = core_v0.19.0, lines 12-305): the same parameters split three ways: TP-sharded
  (attention, dense and shared-expert MLPs, embedding) / TP, replicated (norms, router, shared-expert
  gate) as they are, routed experts / (ETP x EP); experts' optimizer state over the expert
  data-parallel ranks, world / (ETP x EP x PP).
The planner divides what TP splits by TP and routed experts by EP x ETP (experts' state over
world / (EP x ETP x PP)), counts layer by layer as transformers does (q/k norms, biases, routers), and
holds the embedding on the first stage and the output layer on the last. Expected differences: a
fraction of a percent (norms, routers, biases that one side counts and the other not); 0.16's expert
term wherever EP > 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_pipeline.profiles.loader import resolve_run_profile  # noqa: E402
from grpo_pipeline.planner.memory import GIB, estimate  # noqa: E402
from grpo_pipeline.planner.parallel import Layout  # noqa: E402
from grpo_pipeline.profiles.schema import ModelArchitecture  # noqa: E402

QWEN3_8B = {"model_type": "qwen3", "num_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_kv_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "qk_norm": True}
QWEN25_32B = {"model_type": "qwen2", "num_layers": 64, "hidden_size": 5120, "num_attention_heads": 40, "num_kv_heads": 8,
              "head_dim": 128, "intermediate_size": 27648, "vocab_size": 152064, "attention_bias": True}
LLAMA3_70B = {"model_type": "llama", "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_kv_heads": 8,
              "head_dim": 128, "intermediate_size": 28672, "vocab_size": 128256}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_kv_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "vocab_size": 151936, "qk_norm": True}
QWEN3_235B = {**QWEN3_30B_A3B, "num_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
              "moe_intermediate_size": 1536}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_kv_heads": 128, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
               "shared_expert_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 3,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280}

# (name, architecture, devices, TP, PP, EP, ETP)
LAYOUTS = [
    ("Qwen3-8B", QWEN3_8B, 8, 1, 1, 1, 1),
    ("Qwen3-8B", QWEN3_8B, 8, 2, 1, 1, 1),
    ("Qwen3-8B", QWEN3_8B, 16, 4, 2, 1, 1),
    ("Qwen3-8B", QWEN3_8B, 32, 8, 4, 1, 1),
    ("Qwen2.5-32B", QWEN25_32B, 8, 8, 1, 1, 1),
    ("Qwen2.5-32B", QWEN25_32B, 32, 4, 4, 1, 1),
    ("Llama-3-70B", LLAMA3_70B, 64, 8, 4, 1, 1),
    ("Qwen3-30B-A3B", QWEN3_30B_A3B, 8, 2, 1, 1, 2),
    ("Qwen3-30B-A3B", QWEN3_30B_A3B, 8, 1, 1, 8, 1),
    ("Qwen3-30B-A3B", QWEN3_30B_A3B, 16, 2, 1, 8, 1),
    ("Qwen3-235B-A22B", QWEN3_235B, 64, 4, 2, 8, 1),
    ("Qwen3-235B-A22B", QWEN3_235B, 128, 4, 2, 16, 2),
    ("DeepSeek-V3", DEEPSEEK_V3, 512, 8, 1, 64, 1),
]


@dataclass
class MegatronArgs:
    """The Megatron-LM arguments its estimator reads."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: int
    untie_embeddings_and_output_weights: bool
    num_experts: int | None
    moe_ffn_hidden_size: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_layer_pattern: list[int]
    moe_router_topk: int
    mla: dict | None  # q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    world_size: int

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


def megatron_args(arch: dict, world: int, tp: int, pp: int, ep: int, etp: int) -> MegatronArgs:
    mla = None
    if arch.get("kv_lora_rank"):
        mla = {"q_lora_rank": arch.get("q_lora_rank"), "kv_lora_rank": arch["kv_lora_rank"],
               "qk_head_dim": arch["qk_nope_head_dim"], "qk_pos_emb_head_dim": arch["qk_rope_head_dim"],
               "v_head_dim": arch["v_head_dim"]}
    experts = arch.get("num_experts") or None
    dense = arch.get("first_k_dense_replace", 0)
    return MegatronArgs(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"], num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_kv_heads"], kv_channels=arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"],
        ffn_hidden_size=arch.get("intermediate_size") or 0, padded_vocab_size=arch["vocab_size"],
        untie_embeddings_and_output_weights=not arch.get("tie_word_embeddings", False), num_experts=experts,
        moe_ffn_hidden_size=arch.get("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=arch.get("shared_expert_intermediate_size"),
        moe_layer_pattern=[int(bool(experts) and i >= dense) for i in range(arch["num_layers"])],
        moe_router_topk=arch.get("num_experts_per_tok") or 1, mla=mla, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, world_size=world)


def _attention(a: MegatronArgs) -> float:
    """self_attn_term (both versions, lines 62-93 of 0.16.1); RMSNorm: norm_size 1."""
    if a.mla:
        m, h, heads = a.mla, a.hidden_size, a.num_attention_heads
        q = (h * heads * (m["qk_head_dim"] + m["qk_pos_emb_head_dim"]) if m["q_lora_rank"] is None else
             m["q_lora_rank"] * (h + heads * (m["qk_head_dim"] + m["qk_pos_emb_head_dim"]) + 1))
        return (q + m["kv_lora_rank"] * (h + heads * (m["qk_head_dim"] + m["v_head_dim"]) + 1)
                + h * m["qk_pos_emb_head_dim"] + heads * m["v_head_dim"] * h)
    ratio = a.kv_channels * a.num_attention_heads / a.hidden_size
    return 2 * a.hidden_size * a.hidden_size * ((1 + a.num_query_groups / a.num_attention_heads) * ratio)


def megatron_016(a: MegatronArgs) -> float:
    """core_v0.16.1 compute_weight_and_optimizer_memory (distributed optimizer, SwiGLU, RMSNorm)."""
    h, gated = a.hidden_size, 3 / 2
    moe_layers = sum(a.moe_layer_pattern)
    dense_layers = a.num_layers - moe_layers
    experts = a.num_experts or 1
    dense = 2 * h * (a.ffn_hidden_size * gated + 1) + _attention(a)
    moe = 2 * h * ((a.moe_ffn_hidden_size or 0) * experts * gated
                   + (a.moe_shared_expert_intermediate_size or 0) * gated + 1) + _attention(a)
    embedding = h * a.padded_vocab_size
    block = dense * dense_layers + moe * moe_layers + h
    shard = (block / a.pipeline_model_parallel_size + embedding) / a.tensor_model_parallel_size
    if a.untie_embeddings_and_output_weights and a.pipeline_model_parallel_size == 1:
        shard += embedding / a.tensor_model_parallel_size
    return shard * (6 + 12 / a.data_parallel_size)


def megatron_main(a: MegatronArgs) -> float:
    """main (d98e8a64) compute_weight_and_optimizer_memory: TP-sharded, replicated and expert-sharded parts."""
    h, gated, tp, pp = a.hidden_size, 3 / 2, a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    moe_layers = sum(a.moe_layer_pattern)
    dense_layers = a.num_layers - moe_layers
    experts = a.num_experts or 1
    attention = _attention(a)
    dense_mlp = 2 * h * a.ffn_hidden_size * gated
    shared = 2 * h * (a.moe_shared_expert_intermediate_size or 0) * gated
    routed = 2 * h * (a.moe_ffn_hidden_size or 0) * experts * gated
    norms = 2 * h
    router = h * experts if a.num_experts else 0
    embedding = h * a.padded_vocab_size
    tp_sharded = (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers
    replicated = norms * dense_layers + (norms + router) * moe_layers + h
    expert_sharded = routed * moe_layers
    tp_shard = (tp_sharded / pp + embedding) / tp
    if a.untie_embeddings_and_output_weights and pp == 1:
        tp_shard += embedding / tp
    expert_shard = expert_sharded / pp / (a.expert_tensor_parallel_size * a.expert_model_parallel_size)
    expert_dp = a.world_size // (a.expert_tensor_parallel_size * a.expert_model_parallel_size * pp)
    return (tp_shard + replicated / pp) * (6 + 12 / a.data_parallel_size) + expert_shard * (6 + 12 / expert_dp)


def planner_static(arch: dict, world: int, tp: int, pp: int, ep: int, etp: int) -> float:
    """The planner's weights + gradients + optimizer on the fullest stage (nothing offloaded)."""
    per_node = min(world, 8)
    # Every field of the architecture set (the tiny recipe underneath must not leak its own).
    unset = {name: field.default for name, field in ModelArchitecture.model_fields.items() if not field.is_required()}
    overrides = {"model": {"architecture": {**unset, **arch}}, "cluster": {"nnodes": world // per_node, "devices_per_node": per_node},
                 "engine": {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "param_offload": False, "optimizer_offload": False}}
    profile, _ = resolve_run_profile("tiny", "gpu", "verl", overrides=overrides, validate=False)
    lay = Layout(tp, pp, 1, ep, etp, 1, False, False, False, 1)
    update = estimate(profile, lay).roles[0].parts
    return update["weights"] + update["gradients"] + update["optimizer"]


def rows() -> list[dict]:
    out = []
    for name, arch, world, tp, pp, ep, etp in LAYOUTS:
        args = megatron_args(arch, world, tp, pp, ep, etp)
        planner, main, old = planner_static(arch, world, tp, pp, ep, etp), megatron_main(args), megatron_016(args)
        out.append({"model": name, "devices": world, "tp": tp, "pp": pp, "ep": ep, "etp": etp,
                    "planner_gib": planner / GIB, "main_gib": main / GIB, "v016_gib": old / GIB,
                    "vs_main": planner / main, "vs_016": planner / old})
    return out


def main() -> int:
    print("| model | devices | TP | PP | EP | ETP | planner GiB | Megatron-LM main GiB | ratio | core_v0.16.1 GiB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows():
        print(f"| {r['model']} | {r['devices']} | {r['tp']} | {r['pp']} | {r['ep']} | {r['etp']} | {r['planner_gib']:.2f} | "
              f"{r['main_gib']:.2f} | {r['vs_main']:.4f} | {r['v016_gib']:.2f} | {r['vs_016']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
