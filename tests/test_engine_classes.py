"""The training engine as one class per `engine.strategy` (profiles/engine.py): each holds its own settings, a
setting of the other engine is refused with the engine it belongs to named, and profiles saved before the engines
were classes (every engine's settings in one section) still load.

    .venv/bin/python -m pytest -q tests/test_engine_classes.py
"""

from __future__ import annotations

import pytest

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.engine import FsdpEngine, MegatronEngine
from grpo_pipeline.profiles.loader import resolve_profile, resolve_run_profile
from grpo_pipeline.profiles.schema import RunProfile

# engine.* of a profile.yaml / plan.json written before the engine classes: both engines' settings, at defaults
# except what the run set.
SAVED_ENGINE = {"strategy": "megatron", "fsdp_size": -1, "ulysses_sp": 1, "attn_implementation": "sdpa", "tp": 1,
                "pp": 1, "vpp": None, "cp": 1, "ep": 1, "etp": 1, "num_layers_in_first_pipeline_stage": None,
                "num_layers_in_last_pipeline_stage": None, "account_for_embedding_in_pipeline_split": False,
                "account_for_loss_in_pipeline_split": False, "mtp": False, "param_offload": False,
                "optimizer_offload": False, "dtype": "bfloat16", "use_mbridge": True, "vanilla_mbridge": False,
                "use_remove_padding": True, "transformer_overrides": {}, "optimizer_overrides": {}}


@pytest.mark.parametrize(("strategy", "own", "engine"), [
    ("fsdp", {"fsdp_size": 4, "ulysses_sp": 2, "attn_implementation": "flash_attention_2"}, FsdpEngine),
    ("megatron", {"tp": 2, "pp": 4, "transformer_overrides": {"recompute_granularity": "full"}}, MegatronEngine),
])
def test_a_profile_saved_before_the_engine_classes_loads_as_its_engine(strategy, own, engine):
    saved = resolve_profile("smollm2-135m", "gpu", "verl").model_dump(mode="json")
    saved["engine"] = {**SAVED_ENGINE, "strategy": strategy, "param_offload": True, **own}
    profile = RunProfile.model_validate(saved)
    assert type(profile.engine) is engine
    assert profile.engine.param_offload is True and all(getattr(profile.engine, k) == v for k, v in own.items())
    # what it saves now is its own engine's settings only, and loads back the same
    assert set(profile.engine.model_dump()) == set(engine.model_fields)
    assert RunProfile.model_validate(profile.model_dump(mode="json")) == profile


@pytest.mark.parametrize(("overrides", "message"), [
    (["engine.tp=2"], "invalid profile: engine.strategy=fsdp: engine.tp=2 is a Megatron setting FSDP does not read; "
                      "set engine.tp=1 (FSDP shards over engine.fsdp_size ranks) or engine.strategy=megatron"),
    (["engine.transformer_overrides.recompute_granularity=full"], "engine.transformer_overrides={'recompute_granularity': "
                                                                  "'full'} is a Megatron setting FSDP does not read"),
    (["engine.strategy=megatron", "engine.fsdp_size=2"],
     "invalid profile: engine.strategy=megatron: engine.fsdp_size=2 is an FSDP setting; set engine.strategy=fsdp, or "
     "leave engine.fsdp_size out"),
    (["engine.pp=0"], "invalid profile: engine.pp=0: input should be greater than 0"),
    (["engine.strategy=deepspeed"], "invalid profile: engine.strategy='deepspeed': input should be 'megatron' or 'fsdp'"),
    (["engine.fsdp_size=abc"], "invalid profile: engine.fsdp_size='abc': input should be a valid integer"),
])
def test_the_other_engines_setting_is_refused_naming_the_engine_it_belongs_to(overrides, message):
    """Under any backend (the local one here), before anything starts: a Megatron setting on the FSDP recipe, an FSDP
    one under Megatron; a wrong value of the other engine's setting is named for what is wrong with it."""
    with pytest.raises(ProfileError) as refused:
        resolve_profile("smollm2-135m", "cpu", "local", overrides=overrides)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_other_engines_settings_at_their_defaults_are_taken():
    """--suggest-layout's `best:` line switches engines with the other engine's settings set back to defaults."""
    profile = resolve_profile("tiny", "gpu", "verl", overrides=[
        "engine.strategy=fsdp", "engine.tp=1", "engine.vpp=null", "engine.mtp=false", "engine.transformer_overrides={}",
        "engine.num_layers_in_first_pipeline_stage=null", "cluster.devices_per_node=2"])
    assert type(profile.engine) is FsdpEngine
    # YAML's true is no TP of 1: refused as the number it is not
    with pytest.raises(ProfileError, match="engine.tp=True: expects a number, not true/false"):
        resolve_profile("tiny", "gpu", "verl", overrides=["engine.strategy=fsdp", "engine.tp=true"])


def test_an_engine_section_without_strategy_is_megatrons():
    """A recipe's engine settings alone (qwen3.5's) are Megatron's, the default engine."""
    profile, _ = resolve_run_profile("qwen3.5-35b-a3b", "gpu", "verl", validate=False)
    assert type(profile.engine) is MegatronEngine and profile.engine.tp == 2
    assert type(RunProfile.model_validate({**profile.model_dump(), "engine": {"tp": 4}}).engine) is MegatronEngine


def test_a_steps_sequences_are_prompts_times_responses():
    profile = resolve_profile("tiny", "cpu", "local", overrides=["data.train_batch_size=6", "algorithm.rollout_n=3",
                                                                 "actor.ppo_mini_batch_size=2"])
    assert (profile.sequences_per_step, profile.sequences_per_update) == (18, 6)
