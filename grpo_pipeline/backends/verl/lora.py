"""The verl backend's LoRA: verl 0.9.1's keys of its FSDP engine, what it refuses, and its checkpoint's adapter.

    python -m grpo_pipeline --model smollm2-135m --device gpu --backend verl --set lora.rank=32 --dry-run

What verl 0.9.1 reads (its own config and source):
- `actor_rollout_ref.model.lora_rank` / `lora_alpha` (ints) / `target_modules` (`all-linear` or a list):
  trainer/config/model/hf_model.yaml, workers/config/model.py `HFModelConfig`; the FSDP engine wraps the model
  with `peft.get_peft_model(LoraConfig(r, lora_alpha, target_modules, exclude_modules, bias="none"))`
  (workers/engine/fsdp/transformer_impl.py `_build_lora_module`): no dropout is passed, so `lora.dropout` is
  refused here rather than silently dropped. The Megatron engine's LoRA is another config
  (`actor_rollout_ref.model.lora.*`, Megatron-Bridge's module names): refused, with the fix.
- with a LoRA rank the reference policy is the actor with its adapter disabled (`ref_in_actor`:
  trainer/ppo/ray_trainer.py), so verl builds no reference worker: the memory plan has no reference row.
- `actor_rollout_ref.rollout.load_format=safetensors`: vLLM loads the base model itself and only the adapter is
  synced each step (workers/engine_workers.py: `base_sync_done` is `"dummy" not in load_format`); verl's LoRA
  guide (docs/advance/ppo_lora.rst) names it required.
- `actor_rollout_ref.rollout.layered_summon=true`: the adapter is gathered from the FSDP shards layer by layer
  (utils/fsdp_utils.py `collect_lora_params`, which takes that path with FSDP2 and refuses it without
  `load_format=safetensors`).
- vLLM is started with `enable_lora`, one adapter slot and `max_lora_rank` the next of vLLM's ranks
  (workers/rollout/vllm_rollout/vllm_async_server.py, utils.py `get_vllm_max_lora_rank`: at most 512).
Checkpoints: verl's FSDP checkpoint manager writes `lora_train_meta.json` (rank, alpha) beside the shards and, with
`hf_model` in save_contents, the PEFT model's full state dict to `actor/huggingface/` (utils/checkpoint/
fsdp_checkpoint_manager.py): the adapter's tensors are taken from there into PEFT's format, and merged into the
base model by checkpoints/lora_export.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_pipeline.backends.verl.engines import verl_engine
from grpo_pipeline.errors import UserError

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks, as verl 0.9.1 falls back to them
LORA_META = "lora_train_meta.json"


def lora_settings(p: RunProfile) -> dict[str, Any]:
    """verl's keys for the profile's adapter (none without one)."""
    if not p.lora.enabled:
        return {}
    return {"actor_rollout_ref.model.lora_rank": p.lora.rank, "actor_rollout_ref.model.lora_alpha": p.lora.alpha,
            "actor_rollout_ref.model.target_modules": p.lora.target_modules,
            "actor_rollout_ref.rollout.load_format": "safetensors", "actor_rollout_ref.rollout.layered_summon": True}


def lora_problems(p: RunProfile) -> list[str]:
    """What verl 0.9.1 cannot do of the profile's adapter."""
    lora = p.lora
    if not lora.enabled:
        return []
    problems = []
    if not verl_engine(p).trains_lora:
        problems.append(f"lora.rank={lora.rank} with engine.strategy={p.engine.strategy}: verl's LoRA here is its FSDP "
                        "engine's (PEFT); set engine.strategy=fsdp")
    if lora.dropout:
        problems.append(f"lora.dropout={lora.dropout:g}: verl 0.9.1's FSDP engine gives PEFT no dropout; set "
                        "lora.dropout=0 (or train with --backend local)")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        problems.append(f"lora.rank={lora.rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; lower lora.rank")
    return problems


def vllm_lora_rank(rank: int) -> int:
    """The adapter slot vLLM reserves for a rank (verl rounds up to vLLM's allowed ranks)."""
    return next((allowed for allowed in VLLM_LORA_RANKS if rank <= allowed), rank)


def verl_adapter(step_dir: Path) -> Path | None:
    """A LoRA step's adapter alone (`actor/lora_adapter/`, written once); None for a step without one."""
    actor = step_dir / "actor"
    return adapter_from_verl(actor) if (actor / LORA_META).is_file() else None


def merged_policy(step_dir: Path, base_model: Path | None) -> Path | None:
    """A LoRA step's policy: the adapter merged into the base model the run trained from (`actor/merged/`)."""
    from grpo_pipeline.checkpoints.lora_export import MERGED_DIR, base_model_dir, merge_adapter

    if (adapter := verl_adapter(step_dir)) is None:
        return None
    return merge_adapter(adapter, base_model_dir(adapter, base_model), adapter.parent / MERGED_DIR)


def adapter_from_verl(actor: Path, target_modules: list[str] | str | None = None) -> Path:
    """`<actor>/lora_adapter/` in PEFT's format, from the PEFT model's state dict verl wrote to `actor/huggingface/`
    (keys `base_model.model.<module>.lora_A.default.weight`) and the rank and alpha of `lora_train_meta.json`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from grpo_pipeline.checkpoints.lora_export import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, has_adapter
    from grpo_pipeline.checkpoints.staged_output import StagedOutput

    out = actor / ADAPTER_DIR
    if has_adapter(out):
        return out
    hf = actor / "huggingface"
    tensors: dict[str, Any] = {}
    for shard in sorted(hf.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                if ".lora_A." in name or ".lora_B." in name:
                    tensors[name.replace(".default.weight", ".weight")] = handle.get_tensor(name)
    if not tensors:
        raise UserError(f"{actor}: a LoRA checkpoint (lora_train_meta.json) without the adapter's tensors in "
                        f"{hf}; verl writes them there with hf_model in actor.checkpoint_save_contents")
    meta = json.loads((actor / LORA_META).read_text())
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(meta["r"]), "lora_alpha": int(meta["lora_alpha"]),
              "target_modules": target_modules if target_modules else modules, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": None}
    with StagedOutput(out) as staged:
        save_file(tensors, str(staged.path / ADAPTER_WEIGHTS))
        (staged.path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        return staged.commit()
