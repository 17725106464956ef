"""A Hugging Face model directory's `config.json`, read for the numbers a profile validates with.

    python -m grpo_pipeline --model /path/to/hf-dir --device gpu --dry-run   # the architecture comes from here

Used when a profile is built from a local directory and again when the base-model stage checks that
the checkpoint is the model the parallel layout was validated for. Whatever the file holds, the
answer is the numbers or one line saying what is wrong with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_pipeline.store.bounded_read import MAX_JSON_BYTES, read_regular
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.model_size import vision_tower_parameters
from grpo_pipeline.profiles.yaml_files import shown


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a local HF directory, as a JSON object, or a ProfileError saying what is wrong."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(read_regular(config_path, MAX_JSON_BYTES).decode("utf-8"))
    except OSError as exc:
        raise ProfileError(f"model directory {shown(model_dir)}: cannot read config.json ({exc.strerror or exc}); "
                           "give the directory of a Hugging Face model") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ProfileError(f"model directory {shown(model_dir)}: config.json is not JSON text; "
                           "give the directory of a Hugging Face model") from None
    if not isinstance(config, dict):
        raise ProfileError(f"model directory {shown(model_dir)}: config.json holds a JSON {type(config).__name__}, "
                           "not the object of a Hugging Face config")
    return config


# Facts of a model family that its config.json does not spell out.
_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_OUTPUT_GATE_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
_SIGMOID_ROUTED_TYPES = {"deepseek_v3", "kimi_k2", "glm4_moe"}  # n_routed_experts / n_shared_experts
_NUMBERS = ("num_layers", "num_attention_heads", "num_kv_heads", "num_experts", "hidden_size", "vocab_size",
            "linear_num_key_heads", "linear_num_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_experts_per_tok", "full_attention_interval", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers", "vision_parameters",
            "max_position_embeddings")
_STRINGS = ("model_type", "hf_architecture")


def architecture_from_hf_config(model_dir: Path) -> dict[str, Any]:
    """Architecture numbers from a local HF directory's config.json (text_config for multimodal);
    only what the file (or its model type) says: what it leaves out is not returned."""
    config = read_hf_config(model_dir)
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ProfileError(f"model directory {shown(model_dir)}: config.json's text_config is a "
                           f"{type(text).__name__}, not an object")
    # The checkpoint's own type (a multimodal model's, not its text part's): what verl and vLLM build.
    model_type = config.get("model_type") or text.get("model_type")
    try:
        shared_experts = text.get("n_shared_experts") if model_type in _SIGMOID_ROUTED_TYPES else None
        found = {
            "num_layers": text["num_hidden_layers"],
            "num_attention_heads": text["num_attention_heads"],
            "num_kv_heads": text.get("num_key_value_heads", text["num_attention_heads"]),
            "num_experts": text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0,
            "hidden_size": text["hidden_size"],
            "vocab_size": text["vocab_size"],
            "linear_num_key_heads": text.get("linear_num_key_heads"),
            "linear_num_value_heads": text.get("linear_num_value_heads"),
            "head_dim": text.get("head_dim"),
            "intermediate_size": text.get("intermediate_size"),
            "moe_intermediate_size": text.get("moe_intermediate_size"),
            "shared_expert_intermediate_size": text.get("shared_expert_intermediate_size") or (
                shared_experts * text["moe_intermediate_size"] if isinstance(shared_experts, int) and shared_experts > 0
                and isinstance(text.get("moe_intermediate_size"), int) else None),
            "num_experts_per_tok": text.get("num_experts_per_tok"),
            "full_attention_interval": text.get("full_attention_interval") or _full_attention_interval(text.get("layer_types")),
            "linear_key_head_dim": text.get("linear_key_head_dim"),
            "linear_value_head_dim": text.get("linear_value_head_dim"),
            "linear_conv_kernel_dim": text.get("linear_conv_kernel_dim"),
            "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings")),
            "attention_bias": text.get("attention_bias", True if model_type in _QKV_BIAS_TYPES else None),
            "attention_output_gate": text.get("attn_output_gate", True if model_type in _OUTPUT_GATE_TYPES else None),
            "qk_norm": text.get("use_qk_norm", True if model_type in _QK_NORM_TYPES else None),
            "model_type": model_type,
            "hf_architecture": (config.get("architectures") or [None])[0] if isinstance(config.get("architectures"), list)
            else None,
            "first_k_dense_replace": text.get("first_k_dense_replace"),
            "q_lora_rank": text.get("q_lora_rank"),
            "kv_lora_rank": text.get("kv_lora_rank"),
            "qk_nope_head_dim": text.get("qk_nope_head_dim"),
            "qk_rope_head_dim": text.get("qk_rope_head_dim"),
            "v_head_dim": text.get("v_head_dim"),
            "mtp_layers": text.get("num_nextn_predict_layers", text.get("mtp_num_hidden_layers")),
            "vision_parameters": _vision_parameters(config, text, model_dir),
            "max_position_embeddings": text.get("max_position_embeddings"),
        }
    except KeyError as exc:
        raise ProfileError(f"model directory {shown(model_dir)}: config.json has no {exc.args[0]}") from None
    if not found["num_experts"]:  # a dense model's config may still carry MoE defaults
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
                     "first_k_dense_replace"):
            found[name] = None
    if found["kv_lora_rank"] is None:  # multi-latent attention's numbers mean nothing without its latent
        for name in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            found[name] = None
    wrong = [name for name in _NUMBERS if (value := found[name]) is not None
             and (isinstance(value, bool) or not isinstance(value, int) or value < 0)]
    wrong += [name for name, value in found.items() if name not in _NUMBERS + _STRINGS and value is not None
              and not isinstance(value, bool)]
    wrong += [name for name in _STRINGS if found[name] is not None and not isinstance(found[name], str)]
    if wrong:
        raise ProfileError(f"model directory {shown(model_dir)}: config.json's {', '.join(wrong)} must be "
                           "whole numbers (true/false for switches)")
    return {name: value for name, value in found.items() if value is not None}


def _vision_parameters(config: dict[str, Any], text: dict[str, Any], model_dir: Path) -> int | None:
    """The vision tower of a Qwen3.5 checkpoint, counted from its vision_config (other families' towers
    are not sized: their model_type is not in the size model)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or not str(config.get("model_type", "")).startswith("qwen3_5"):
        return None
    try:
        return vision_tower_parameters(vision, vision.get("out_hidden_size") or text["hidden_size"])
    except (KeyError, TypeError):
        raise ProfileError(f"model directory {shown(model_dir)}: config.json's vision_config lacks the numbers of "
                           "the vision tower (whole numbers: depth, hidden_size, intermediate_size, patch_size, "
                           "temporal_patch_size, spatial_merge_size, num_position_embeddings)") from None


def _full_attention_interval(layer_types: Any) -> int | None:
    """Every N-th layer full attention, from a hybrid config's `layer_types` (transformers writes that list
    instead of `full_attention_interval`); None for another pattern (the size model then says it lacks it)."""
    if not isinstance(layer_types, list) or "full_attention" not in layer_types:
        return None
    interval = layer_types.index("full_attention") + 1
    regular = all((kind == "full_attention") == ((i + 1) % interval == 0) for i, kind in enumerate(layer_types))
    return interval if regular and interval > 1 else None
