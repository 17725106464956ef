"""flows/serve.py builds its deployments from prefect.yaml, so the two never drift apart."""

from __future__ import annotations

import pytest
import yaml

from flows.request import RunRequest
from flows.serve import PREFECT_YAML, deployments_in, to_runner_deployment
from profiles.errors import UserError


def test_served_deployments_carry_prefect_yaml_s_settings():
    entries = yaml.safe_load(PREFECT_YAML.read_text())["deployments"]
    for entry in entries:
        deployment = to_runner_deployment(entry)
        assert deployment.name == entry["name"] and deployment.parameters == entry["parameters"]
        assert deployment.concurrency_limit == 1
        assert [s.active for s in deployment.schedules] == [s["active"] for s in entry["schedules"]]
        RunRequest(**entry["parameters"]["request"])  # every deployment's parameters are a valid request


def test_an_unknown_deployment_name_is_refused_with_the_known_ones():
    with pytest.raises(UserError, match="no deployment named nope .* local-smoke"):
        deployments_in(PREFECT_YAML, ["nope"])
