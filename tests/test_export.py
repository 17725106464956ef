"""The export stage: the trained policy's directory, as its backend says, checked and scanned for
NaN / Inf."""

from __future__ import annotations

import shutil

import pytest

from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.errors import UserError
from grpo_pipeline.stages.export import export_checkpoint
from grpo_pipeline.stages.model import ModelFormatError


def trained(backend: str, checkpoint_dir: str, step: int) -> TrainResult:
    return TrainResult(backend=backend, checkpoint_dir=checkpoint_dir, steps_done=step, max_steps=step, metrics_file="")


def test_export_checks_the_policy_and_refuses_a_diverged_one(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    step_dir = tmp_path / "checkpoints" / "global_step_4"
    shutil.copytree(tiny_model_dir, step_dir)
    exported = export_checkpoint(trained("local", str(step_dir), 4))
    assert exported.path == str(step_dir) and exported.num_parameters == 106_880
    tensors = load_file(step_dir / "model.safetensors")
    tensors["model.norm.weight"][3] = torch.nan
    save_file(tensors, step_dir / "model.safetensors")
    with pytest.raises(ModelFormatError, match="model.norm.weight has NaN or Inf values"):
        export_checkpoint(trained("local", str(step_dir), 4))
    with pytest.raises(UserError, match="run the train stage first"):
        export_checkpoint(trained("local", "", 0))


def test_a_verl_step_with_an_hf_export_is_used_as_it_is(tiny_model_dir, tmp_path):
    exported = tmp_path / "global_step_50" / "actor" / "model" / "huggingface"
    shutil.copytree(tiny_model_dir, exported)
    assert export_checkpoint(trained("verl", str(tmp_path / "global_step_50"), 50)).path == str(exported)


def test_an_fsdp_step_exports_the_hf_weights_verl_writes_beside_its_shards(tiny_model_dir, tmp_path):
    """verl's FSDP checkpoint: sharded .pt files in actor/, the policy's HF weights in actor/huggingface
    (`hf_model` in save_contents, which the rendering adds for FSDP)."""
    step = tmp_path / "global_step_6"
    shutil.copytree(tiny_model_dir, step / "actor" / "huggingface")
    (step / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"")
    (step / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 2}')  # with every save
    assert export_checkpoint(trained("verl", str(step), 6)).path == str(step / "actor" / "huggingface")
    shutil.rmtree(step / "actor" / "huggingface")
    (step / "actor" / "huggingface").mkdir()
    (step / "actor" / "huggingface" / "config.json").write_text("{}")  # what verl writes without hf_model
    with pytest.raises(UserError, match="add hf_model to actor.checkpoint_save_contents"):
        export_checkpoint(trained("verl", str(step), 6))
