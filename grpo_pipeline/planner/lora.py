"""LoRA at planning: the adapter's target modules against the model's own module names, and the adapter's size.

    python -m grpo_pipeline --model /models/Qwen3-8B --device gpu --set lora.rank=16 --set 'lora.target_modules=[qkv_proj]' --dry-run   # refused

The model is built on PyTorch's meta device (no memory, no weights: a fraction of a second for an 8B
model) from its config: a model directory's config.json as the profile read it, else the recipe's
architecture numbers under its `model_type`. Its linear modules are matched as PEFT matches them (a
listed name matches a module whose dotted name is it or ends with `.<name>`; `all-linear`: every linear
layer but the output layer), so a name that matches nothing is refused here, in one line with the
model's own names, rather than by PEFT after the workers (or verl's job) loaded the model. The matched
modules' shapes give the adapter's parameter count, which the memory plans use (backends/local/
train_memory.py, planner/fsdp.py). A model transformers cannot build from its numbers is left to PEFT's
own check when the model loads (`adapter_size` is then None and the plans count no adapter).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_pipeline.errors import HEADLINE_CHARS
from grpo_pipeline.profiles.lora import ALL_LINEAR

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile

# The architecture numbers of a profile, as a Hugging Face config names them (a recipe's model is built from these).
HF_KEYS = {"num_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "hidden_size": "hidden_size", "vocab_size": "vocab_size",
           "head_dim": "head_dim", "intermediate_size": "intermediate_size", "tie_word_embeddings": "tie_word_embeddings",
           "attention_bias": "attention_bias", "num_experts": "num_experts", "moe_intermediate_size": "moe_intermediate_size",
           "num_experts_per_tok": "num_experts_per_tok", "max_position_embeddings": "max_position_embeddings"}


@dataclass(frozen=True)
class AdapterSize:
    """The adapter of a profile on its model: which modules it adapts and its parameters."""

    modules: int  # adapted linear modules
    parameters: int  # r x (in + out), summed
    per_layer: dict[str, int]  # an adapted module's short name -> its in_features (one decoder layer's, the widest)
    names: tuple[str, ...]  # the short names of the model's linear modules (for a refusal)


def linear_modules(p: RunProfile) -> dict[str, tuple[int, int]] | None:
    """Every linear module of the model but its output layer, by dotted name: (in_features, out_features);
    None when transformers cannot build the model from what the profile knows."""
    found = _model_linears(p)
    return None if found is None else found[0]


def _model_linears(p: RunProfile) -> tuple[dict[str, tuple[int, int]], str] | None:
    """`linear_modules`, and the output layer's name."""
    model = p.model
    if (found := _meta_linears(_config_json(Path(model.path).expanduser(), model.architecture.model_dump()))) is None:
        return None
    linears, output = found
    return {name: (i, o) for name, i, o in linears}, output


def targeted(p: RunProfile, modules: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The modules `lora.target_modules` adapts, as PEFT matches them."""
    targets = p.lora.target_modules
    if targets == ALL_LINEAR:
        return dict(modules)
    return {name: shape for name, shape in modules.items()
            if any(name == target or name.endswith("." + target) for target in targets)}


def adapter_size(p: RunProfile) -> AdapterSize | None:
    """The profile's adapter on its model; None without LoRA or where the model cannot be built."""
    if not p.lora.enabled or (modules := linear_modules(p)) is None:
        return None
    chosen = targeted(p, modules)
    per_layer: dict[str, int] = {}
    for name, (features_in, _) in chosen.items():
        short = name.rsplit(".", 1)[-1]
        per_layer[short] = max(per_layer.get(short, 0), features_in)
    return AdapterSize(modules=len(chosen), parameters=sum(p.lora.rank * (i + o) for i, o in chosen.values()),
                       per_layer=per_layer, names=tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n in modules)))


def lora_problems(p: RunProfile) -> list[str]:
    """A target module the model does not have (each listed name must match some module), or its output layer."""
    if not p.lora.enabled or p.lora.target_modules == ALL_LINEAR or (found := _model_linears(p)) is None:
        return []
    modules, output = found
    names = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in modules))
    missing = [t for t in p.lora.target_modules if not targeted(p.model_copy(update={"lora": p.lora.model_copy(
        update={"target_modules": [t]})}), modules)]
    if not missing:
        return []
    # TRL and verl score log-probs from the output layer's weight directly: it takes no adapter.
    ends = [t for t in missing if output == t or output.endswith("." + t)]
    why = f"{', '.join(ends)} is the output layer" if ends else f"the model has no module named {', '.join(missing)}"
    line = f"lora.target_modules: {why}; its linear modules are {', '.join(names)} (or use {ALL_LINEAR})"
    if len(line) <= HEADLINE_CHARS - len("invalid profile: "):
        return [line]
    return [f"lora.target_modules: {why}; name some of its linear modules (below) or use {ALL_LINEAR}\n"
            f"  its linear modules: {', '.join(names)}"]


def _config_json(model_dir: Path, architecture: dict[str, Any]) -> str:
    """The model's config as JSON: its directory's config.json when there is one, else one made from the numbers."""
    if (model_dir / "config.json").is_file():
        from grpo_pipeline.profiles.hf_config import read_hf_config

        return json.dumps(read_hf_config(model_dir), sort_keys=True)
    numbers = {HF_KEYS[k]: v for k, v in architecture.items() if k in HF_KEYS and v is not None}
    if not numbers.get("num_experts"):
        numbers.pop("num_experts", None)
    numbers["model_type"] = architecture.get("model_type") or "llama"
    return json.dumps(numbers, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _meta_linears(config_json: str) -> tuple[tuple[tuple[str, int, int], ...], str] | None:
    """((name, in, out) of every linear module but the output layer, the output layer's name) of the model
    the config describes, built on the meta device; None when transformers cannot build it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(json.loads(config_json))
    try:
        config = AutoConfig.for_model(config.pop("model_type", None) or "llama", **config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, RuntimeError, ImportError):
        return None
    output = model.get_output_embeddings()
    output_name = next((name for name, m in model.named_modules() if m is output), "")
    return tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and m is not output), output_name


def describe_adapter(p: RunProfile) -> str | None:
    """The dry run's line on the adapter: what it adapts, its size beside the model's, and the reference."""
    if not p.lora.enabled:
        return None
    from grpo_pipeline.profiles.model_size import model_size, size_problems

    size = adapter_size(p)
    text = p.lora.describe()
    if size is not None:
        total = None if size_problems(p.model.architecture) else model_size(p.model.architecture).total
        share = f" ({100 * size.parameters / total:.2f}% of the model's {total:,})" if total else ""
        text += f": {size.modules} modules, {size.parameters:,} trainable parameters{share}"
    else:
        text += " (transformers cannot build this model from its numbers: PEFT checks the modules when it loads)"
    if p.uses_reference_model:
        text += "; the reference policy is the base model with the adapter disabled (no second copy of the weights)"
    return text
