"""A LoRA policy exported twice: the adapter alone (PEFT's format) and the merged Hugging Face model.

    python -m grpo_pipeline --model tiny --device cpu --set lora.rank=8 --stages export_checkpoint --run-name try1

A LoRA run's checkpoint holds the adapter, not the policy's weights. The export stage writes, beside the
checkpoint's own files:
- `lora_adapter/`: `adapter_config.json` + `adapter_model.safetensors`, what `peft.PeftModel.from_pretrained(base,
  path)` and vLLM's `--lora-modules` load, with the tokenizer;
- `merged/`: the base model with W + (alpha / r) B A in every adapted layer (PEFT's `merge_and_unload`), a plain HF
  model directory in the base model's dtype, with the tokenizer: what the evaluation stage generates with and what
  ships without PEFT.
Each is written beside itself and renamed into place when complete (checkpoints/staged_output.py), so a killed export
leaves nothing half-written and the next one writes it again; one already there is used as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpo_pipeline.store.bounded_read import MAX_JSON_BYTES, read_regular
from grpo_pipeline.errors import UserError
from grpo_pipeline.checkpoints.staged_output import StagedOutput

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_DIR = "lora_adapter"
MERGED_DIR = "merged"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")


def has_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def adapter_config(path: Path) -> dict:
    try:
        config = json.loads(read_regular(path / ADAPTER_CONFIG, MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"{path / ADAPTER_CONFIG}: cannot be read as JSON ({exc}); the checkpoint is damaged: "
                        "export an earlier step") from None
    if not isinstance(config, dict):
        raise UserError(f"{path / ADAPTER_CONFIG}: not a JSON object; the checkpoint is damaged: export an earlier step")
    return config


def base_model_dir(adapter: Path, base_model: Path | None = None) -> Path:
    """The base model the adapter was trained on: `base_model` when given, else the adapter config's
    `base_model_name_or_path` (the local directory the trainer loaded)."""
    named = base_model or Path(str(adapter_config(adapter).get("base_model_name_or_path") or ""))
    if not (named / "config.json").is_file():
        raise UserError(f"{adapter}: its base model {str(named) or '(not named)'} is not a model directory here; the "
                        "merged policy needs it: run the export where the base model's folder is (model.root)")
    return named


def export_adapter(checkpoint: Path, tokenizer_dir: Path | None = None) -> Path:
    """`<checkpoint>/lora_adapter/`: the adapter's two files and the tokenizer, copied from the checkpoint."""
    out = checkpoint / ADAPTER_DIR
    if has_adapter(out):
        return out
    with StagedOutput(out) as staged:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(checkpoint / name, staged.path / name)
        _copy_tokenizer(tokenizer_dir or checkpoint, staged.path)
        return staged.commit()


def merge_adapter(adapter: Path, base: Path, out: Path) -> Path:
    """`out`: the base model with the adapter merged into its weights (PEFT's merge_and_unload), in the
    base model's dtype, with the adapter's tokenizer (or the base model's)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(AutoConfig.from_pretrained(base), "dtype", None) or torch.float32
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with StagedOutput(out) as staged:
        merged.save_pretrained(staged.path)
        _copy_tokenizer(adapter if (adapter / "tokenizer_config.json").is_file() else base, staged.path)
        return staged.commit()


def export_lora_policy(checkpoint: Path, base_model: Path | None = None) -> tuple[Path, Path]:
    """(the adapter alone, the merged model) of a LoRA checkpoint, written once (see the module)."""
    adapter = export_adapter(checkpoint)
    return adapter, merge_adapter(adapter, base_model_dir(adapter, base_model), checkpoint / MERGED_DIR)


def _copy_tokenizer(source: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
