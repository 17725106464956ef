"""The local backend's reach below TRL's public API (backends/local/trl_hooks.py): each private method it
overrides or wraps has the signature it was checked with, in the installed TRL; a release whose
signature moved is named, and refused at a run's start; the workers' GRPOConfig fields are typed."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from grpo_pipeline.backends.local.mapping import GrpoFields
from grpo_pipeline.backends.local.trl_hooks import PRIVATE_METHODS, TRL_CHECKED, check_trl, signature_drift
from grpo_pipeline.errors import UserError


@pytest.mark.parametrize("name", sorted(PRIVATE_METHODS))
def test_each_private_method_has_the_signature_it_was_checked_with(name):
    from trl import GRPOTrainer

    now = str(inspect.signature(getattr(GRPOTrainer, name)))
    assert now == PRIVATE_METHODS[name], (
        f"TRL's GRPOTrainer.{name} is now {now}: check backends/local/trl_hooks.py's override against this "
        f"release, then record the signature and the release in TRL_CHECKED")


def test_the_installed_trl_is_a_checked_release_with_no_drift():
    from importlib.metadata import version

    assert version("trl") in TRL_CHECKED, f"trl {version('trl')} is not in TRL_CHECKED ({TRL_CHECKED})"
    assert signature_drift() == [] and check_trl() is None


def moved_trainer():
    """TRL's GRPOTrainer as a release that changed the generation seam's signature would have it."""
    from trl import GRPOTrainer

    class Moved(GRPOTrainer):
        def _generate_single_turn(self, prompts, num_generations):
            """A newer TRL's shape: only its signature is read."""

    return Moved


def test_a_release_whose_signature_moved_is_named_and_refused():
    drift = signature_drift(moved_trainer())
    assert drift == ["GRPOTrainer._generate_single_turn is now (self, prompts, num_generations), checked as "
                     f"{PRIVATE_METHODS['_generate_single_turn']}"]
    with pytest.raises(UserError) as refused:
        check_trl("9.0.0", moved_trainer())
    message = str(refused.value)
    assert "\n" not in message and message.startswith("trl 9.0.0: ")
    assert "_generate_single_turn is now (self, prompts, num_generations)" in message and "pip install 'trl==1.16.*'" in message


def test_an_unchecked_release_with_the_recorded_signatures_runs_with_a_warning():
    from trl import GRPOTrainer

    warning = check_trl("1.17.0", GRPOTrainer)
    assert warning.startswith("trl 1.17.0 is not a release the local backend was checked on (trl==1.16.*)")
    assert check_trl("1.16.3", GRPOTrainer) is None


def test_the_workers_grpo_fields_are_grpoconfig_fields_with_its_defaults():
    from trl import GRPOConfig

    config = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    for name, field in GrpoFields.model_fields.items():
        assert name in config, f"GrpoFields.{name} is no GRPOConfig field"
        if not field.is_required():
            assert field.default == config[name].default, f"GrpoFields.{name}: default {field.default!r}, TRL's {config[name].default!r}"


def test_the_workers_settings_carry_typed_grpo_fields_through_json():
    """What the driver ships to Ray Train's workers is JSON-able data that comes back as the typed model."""
    from grpo_pipeline.backends.local.mapping import grpo_fields
    from grpo_pipeline.generation.plan import plan_generation
    from grpo_pipeline.stages.plan import resolve_profile

    profile = resolve_profile("tiny", "cpu")
    fields, _ = grpo_fields(profile, 1, plan_generation(profile))
    assert GrpoFields.model_validate_json(fields.model_dump_json()) == fields
    with pytest.raises(ValueError, match="num_generation"):
        GrpoFields.model_validate({**fields.model_dump(), "num_generation": 4})  # a misspelt field is refused


def test_what_the_local_trainer_adds_is_no_name_of_trls_trainer():
    """The pipeline's trainer adds public names of its own: none shadows one TRL or transformers has."""
    import re

    import transformers.trainer
    import trl.trainer.grpo_trainer

    from grpo_pipeline.backends.local.trl_hooks import PUBLIC_OVERRIDES, grpo_trainer_class

    local, trl_trainer = grpo_trainer_class(), grpo_trainer_class().__mro__[1]
    added = {name for name in vars(local) if not name.startswith("_") and name not in PUBLIC_OVERRIDES}
    added |= set(re.findall(r"self\.([a-z]\w*)", inspect.getsource(local.__init__)))
    theirs = set(dir(trl_trainer))
    for module in (trl.trainer.grpo_trainer, transformers.trainer):
        theirs |= set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(module)))
    assert added >= {"native", "probe", "packed", "timer", "native_refusal", "native_decoder", "probe_logprobs"}
    assert added & theirs == set()
    assert all(callable(getattr(trl_trainer, name, None)) for name in PUBLIC_OVERRIDES)  # no override of a gone method
