"""flows/serve.py builds its deployments from prefect.yaml, so the two never drift apart."""

from __future__ import annotations

import pytest
import yaml

from flows.plan import check_plan
from flows.request import RunRequest
from flows.serve import PREFECT_YAML, deployments_in, to_runner_deployment
from profiles.errors import UserError
from profiles.loader import resolve_profile


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


def test_verl_training_is_refused_before_anything_is_fetched_and_staging_is_not():
    from stages.device import detect_device

    profile, npu = resolve_profile("qwen3.5-122b-a10b", "npu"), detect_device("npu", dry_run=True)
    with pytest.raises(UserError, match="does not submit verl training yet"):
        check_plan(RunRequest(model="qwen3.5-122b-a10b"), profile, npu, dry_run=False)
    staging = RunRequest(model="qwen3.5-122b-a10b", stages=["fetch_dataset", "prepare_checkpoint"])
    check_plan(staging, profile, npu, dry_run=False)
