"""A verl checkpoint step as a Hugging Face directory, for the export stage.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --stages export_checkpoint --run-name <run>

Where verl 0.9.1 keeps the policy of `global_step_N/` (docs/verl-stand-in.md has the file:line):
- Megatron engine (layout v2): `actor/model/huggingface/` holds the bridge's HF weights, config and
  tokenizer whenever it saves HF weights ('hf_model' in save_contents, or 'model' without
  `use_dist_checkpointing`): used as they are. With `use_dist_checkpointing` and no 'hf_model' the
  weights are a megatron-core dist checkpoint in `actor/model/dist_ckpt/` and verl writes no
  `huggingface/` at all: converted back to HF safetensors here, streamed, on the CPU, into
  `actor/huggingface-export/` (staged and renamed into place, so a half-written one is never found),
  named by the HF config of `model/huggingface/` if there is one, else of the base model the job
  trained from.
- FSDP engine: `actor/huggingface/` always holds the config and tokenizer, and the HF weights only with
  'hf_model' in save_contents; otherwise the policy is only in per-rank sharded torch files
  (`model_world_size_W_rank_R.pt`), which need verl's own merger (with verl installed).
verl's Megatron merger is not used: it needs NCCL/HCCL accelerators and has no Qwen3.5 support.
"""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.errors import UserError

EXPORT_DIR = "huggingface-export"
FSDP_CONFIG = "fsdp_config.json"  # written by verl's FSDP checkpoint manager with every save


def _has_hf_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def verl_hf_dir(step_dir: Path, base_model: Path | None = None) -> Path:
    """The step's policy as an HF directory: verl's own HF weights (Megatron's `model/huggingface`,
    FSDP's `huggingface`), else its dist checkpoint converted. `base_model`: the HF directory the run
    trained from, whose config names a dist checkpoint's tensors when verl saved no HF config."""
    from grpo_pipeline.checkpoints.megatron_layout import dist_to_hf

    actor = step_dir / "actor"
    for exported in (actor / "model" / "huggingface", actor / "huggingface"):
        if _has_hf_weights(exported):
            return exported
    converted = actor / EXPORT_DIR
    if (converted / "config.json").is_file():
        return converted
    if (actor / FSDP_CONFIG).is_file():
        raise UserError(
            f"{step_dir}: verl's FSDP checkpoint holds the policy only as sharded torch files "
            "(model_world_size_*_rank_*.pt); add hf_model to actor.checkpoint_save_contents so verl also writes HF "
            f"weights to actor/huggingface, or merge this step where verl is installed: python -m verl.model_merger "
            f"merge --backend fsdp --local_dir {actor} --target_dir {actor / 'huggingface'}")
    dist = actor / "model" / "dist_ckpt"
    if not (dist / ".metadata").is_file():
        raise UserError(f"{step_dir}: no policy to export: neither HF weights in actor/model/huggingface or "
                        "actor/huggingface nor a complete dist checkpoint in actor/model/dist_ckpt (verl writes one of "
                        "them when actor_rollout_ref.actor.checkpoint.save_contents holds 'model')")
    config_dir = actor / "model" / "huggingface"
    if not (config_dir / "config.json").is_file():
        config_dir = base_model
    if config_dir is None or not (config_dir / "config.json").is_file():
        raise UserError(f"{dist}: no HF config to name the dist checkpoint's tensors: verl writes "
                        "actor/model/huggingface only when it saves HF weights, and the base model "
                        f"{base_model or '(not recorded in the run)'} has no config.json; run the export with the "
                        "base model's folder in place, or add hf_model to actor.checkpoint_save_contents")
    return dist_to_hf(dist, config_dir, converted)
