"""The deployments' form (flows/form.py): what its JSON-schema patterns refuse is what the run itself
refuses, so a value the form lets through does not fail the run for the same reason, and the other
way round."""

from __future__ import annotations

import inspect
import re

import pytest

from flows.form import run_from_form
from flows.request import OVERRIDE_LINES, RunRequest
from common.errors import UserError

FORM = {name: p.default for name, p in inspect.signature(run_from_form.fn).parameters.items()
        if p.default is not inspect.Parameter.empty} | {"model": "tiny", "device": "cpu"}


@pytest.mark.parametrize("overrides", [
    "", "engine.tp=4", "trainer.total_training_steps=3\nengine.tp=2", "env.HF_TOKEN=${HF_TOKEN}",
    "env.MIRROR_AUTH=${HF_TOKEN}", "env.X=${HOME:-/tmp}", "engine.tp=4\n\nmodel.path=x\n", "a=1\r\nb=2",
    "env.HF_TOKEN=made-up-value-0000", "env.hf_token = made-up", "env.HF_TOKEN=${HF_TOKEN:-x}",
    "env.MIRROR_AUTH=${HF_TOKEN:-x}", "env.DB_URL=postgres://user:made-up@db/x", "data.source=https://tok@mirror/x",
    "no equals sign", "a=1\nno equals sign", "env.HF_TOKEN=${HF_TOKEN}\nengine.tp=2\nenv.API_KEY=zzz",
])
def test_the_forms_override_pattern_refuses_exactly_what_the_run_refuses(overrides):
    form_accepts = re.search(OVERRIDE_LINES, overrides) is not None
    try:
        RunRequest.from_form(**{**FORM, "overrides": overrides})
        run_accepts = True
    except UserError:
        run_accepts = False
    assert form_accepts == run_accepts


def test_empty_text_boxes_mean_the_defaults():
    request = RunRequest.from_form(**FORM)
    assert (request.overrides, request.profile_file, request.run_name, request.ray_address) == ([], None, None, None)
    assert request.run_root == "runs" and request.stages[-1] == "report"


def test_a_bad_field_is_one_line_naming_it():
    with pytest.raises(UserError, match=r"^run_name: Value error|^run_name: run name 'two words' must be"):
        RunRequest.from_form(**{**FORM, "run_name": "two words"})
