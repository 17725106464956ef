"""flows/serve.py builds its deployments from prefect.yaml, so the two never drift apart."""

from __future__ import annotations

import inspect

import pytest
import yaml

from grpo_pipeline.flows.form import run_from_form
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.flows.serve import PREFECT_YAML, deployments_in, to_runner_deployment
from grpo_pipeline.errors import UserError


FORM_DEFAULTS = {name: p.default for name, p in inspect.signature(run_from_form.fn).parameters.items()
                 if p.default is not inspect.Parameter.empty}


def test_served_deployments_carry_prefect_yaml_s_settings():
    entries = yaml.safe_load(PREFECT_YAML.read_text())["deployments"]
    for entry in entries:
        deployment = to_runner_deployment(entry)
        assert deployment.name == entry["name"] and deployment.parameters == entry["parameters"]
        assert deployment.concurrency_limit == 1
        assert [s.active for s in deployment.schedules] == [s["active"] for s in entry["schedules"]]
        # Every deployment's parameters, with the form's defaults for the rest, make a valid request.
        RunRequest.from_form(**{**FORM_DEFAULTS, **entry["parameters"]})


def test_an_unknown_deployment_name_is_refused_with_the_known_ones():
    with pytest.raises(UserError, match="no deployment named nope .* local-smoke"):
        deployments_in(PREFECT_YAML, ["nope"])
