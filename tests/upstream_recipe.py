"""The upstream verl recipe for Qwen3.5-122B-A10B (verl PR #6582,
examples/grpo_trainer/run_qwen3_5_122b_a10b_megatron.sh) as the Hydra overrides it passes to
`main_ppo`, per device, transcribed from shared/reference/upstream-recipe.md section 2.

`with_grad_offload=False` drops `actor.megatron.grad_offload`, the one key verl 0.9.1 no longer has;
everything else is as upstream wrote it, duplicates included (npu sets vanilla_mbridge twice).
"""

from __future__ import annotations

from pathlib import Path

PER_DEVICE = {
    "gpu": dict(pp=2, ep=8, gen_tp=8, devices=8, mem=0.66, logprob_mbs=1, max_model_len=15768),
    "npu": dict(pp=4, ep=16, gen_tp=16, devices=16, mem=0.6, logprob_mbs=4, max_model_len=8192),
}
DATA_DIR = Path("~/data/geo3k").expanduser()
CHECKPOINT_DIR = "Qwen/Qwen3.5-122B/verl_checkpoint"  # upstream's relative save_path


def upstream_overrides(device: str, with_grad_offload: bool = True) -> list[str]:
    d = PER_DEVICE[device]
    actor = [
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        "actor_rollout_ref.actor.megatron.use_mbridge=True",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={d['pp']}",
        "actor_rollout_ref.actor.megatron.context_parallel_size=1",
        f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={d['ep']}",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        "actor_rollout_ref.actor.megatron.param_offload=True",
        "actor_rollout_ref.actor.megatron.optimizer_offload=True",
        *(["actor_rollout_ref.actor.megatron.grad_offload=True"] if with_grad_offload else []),
        "actor_rollout_ref.actor.megatron.dtype=bfloat16",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
        "actor_rollout_ref.actor.megatron.use_remove_padding=False",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion=True",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=True",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
        "actor_rollout_ref.actor.use_torch_compile=True",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model', 'extra', 'optimizer']",
    ]
    rollout = [
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={d['gen_tp']}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={d['mem']}",
        "actor_rollout_ref.rollout.n=6",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={d['logprob_mbs']}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len={d['max_model_len']}",
    ]
    ref = [
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={d['logprob_mbs']}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=False",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
        f"actor_rollout_ref.ref.megatron.pipeline_model_parallel_size={d['pp']}",
        "actor_rollout_ref.ref.megatron.context_parallel_size=1",
        f"actor_rollout_ref.ref.megatron.expert_model_parallel_size={d['ep']}",
        "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1",
        "actor_rollout_ref.ref.megatron.param_offload=True",
    ]
    model = [
        "actor_rollout_ref.model.path=Qwen/Qwen3.5-122B-A10B",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.model.use_remove_padding=False",
    ]
    common = ["actor_rollout_ref.nccl_timeout=10800"]
    algorithm = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False"]
    data = [
        f"data.train_files={DATA_DIR / 'train.parquet'}",
        f"data.val_files={DATA_DIR / 'test.parquet'}",
        "data.train_batch_size=128",
        "data.max_prompt_length=3240",
        "data.max_response_length=4096",
        "data.truncation=right",
        "data.filter_overlong_prompts=True",
        "data.filter_overlong_prompts_workers=64",
    ]
    trainer = [
        "trainer.logger=['console','wandb']",
        "trainer.project_name=verl_grpo_qwen3_5_122b_geo3k",
        "trainer.experiment_name=qwen3_5_122b_megatron",
        f"trainer.n_gpus_per_node={d['devices']}",
        "trainer.nnodes=4",
        "trainer.save_freq=50",
        f"trainer.default_local_dir={CHECKPOINT_DIR}",
        "trainer.test_freq=10",
        "trainer.val_before_train=False",
        "trainer.total_epochs=20",
    ]
    if device == "gpu":
        actor += [
            '+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type="none"',
            "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
        ]
    else:
        actor += [
            "actor_rollout_ref.actor.megatron.vanilla_mbridge=False",
            "actor_rollout_ref.actor.checkpoint.strict=False",
            "++actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=auto",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=True",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.use_naive_l2norm=True",
        ]
    return [*algorithm, *data, *model, *common, *trainer, *rollout, *actor, *ref, "model_engine=megatron"]
