"""The deployments of prefect.yaml, the way their users run them: a real `prefect server` on
127.0.0.1, `prefect deploy`, a flow run created through the API from the form's parameters (as the
UI does), and a process worker that runs it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_pipeline.flows.local_api import LocalAPI

REPO = Path(__file__).resolve().parents[2]
# Prefect's CLI through this interpreter: its `prefect` script need not sit beside it.
PREFECT = [sys.executable, "-m", "prefect"]
FLOW_RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A started Prefect server (SQLite under a fresh PREFECT_HOME); yields the env that points at it.
    It runs no background services, so no scheduled run of the deployments competes with the test's."""
    home = tmp_path_factory.mktemp("prefect-home")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    api = LocalAPI(home / "api.log", env=env)
    try:
        api.wait_ready(timeout=180)
        yield {**env, "PREFECT_API_URL": api.url}
    finally:
        api.stop()


def _prefect(env: dict, *args: str, timeout: float = 300) -> str:
    done = subprocess.run([*PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def deployed(server):
    _prefect(server, "work-pool", "create", "grpo-process", "--type", "process")
    _prefect(server, "deploy", "--all", "--no-prompt")
    return server


def _api(env: dict, call):
    """Run `call(client)` against the started server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        async with get_client() as client:
            return await call(client)

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        return asyncio.run(go())


def test_every_deployment_of_prefect_yaml_is_registered_with_its_settings(deployed):
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for entry in spec["deployments"]:
        deployment = _api(deployed, lambda c, n=entry["name"]: c.read_deployment_by_name(f"grpo_pipeline/{n}"))
        assert deployment.work_pool_name == "grpo-process"
        assert deployment.work_queue_name == entry["work_pool"]["work_queue_name"]
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.parameters == entry["parameters"]
        assert deployment.job_variables["env"] == entry["work_pool"]["job_variables"]["env"]
        (schedule,) = deployment.schedules
        # Only the smoke run is on a schedule by default; the big models' cron is an example, off.
        assert schedule.active == (entry["name"] == "local-smoke")
        assert schedule.schedule.cron


def test_the_form_is_the_fields_a_person_fills_each_described_and_checked(deployed):
    from prefect.utilities.schema_tools import validate

    deployment = _api(deployed, lambda c: c.read_deployment_by_name("grpo_pipeline/local-smoke"))
    schema = deployment.parameter_openapi_schema
    assert deployment.enforce_parameter_schema  # the API checks the form's rules before it stores a run
    fields = schema["properties"]
    assert list(fields) == ["model", "device", "backend", "overrides", "stages", "run_name", "run_root", "ray_address",
                            "profile_file", "trackers"]
    assert schema["required"] == ["model"]
    for name, field in fields.items():
        assert field.get("description"), name
        assert "anyOf" not in field, name  # no str/None toggle: an empty text box means the default
    assert fields["device"]["enum"] == ["auto", "gpu", "npu", "cpu"]
    assert "train" in fields["stages"]["items"]["enum"] and fields["stages"]["default"][-1] == "report"
    ok = {**deployment.parameters, "overrides": "trainer.total_training_steps=2\nenv.HF_TOKEN=${HF_TOKEN}",
          "run_name": "a-run"}
    validate(ok, schema, raise_on_error=True)
    for bad in ({"overrides": "env.HF_TOKEN=made-up-value-1234"}, {"overrides": "no equals sign"},
                {"overrides": "data.source=https://user:made-up-pass@mirror/x"}, {"run_name": "has space"}):
        with pytest.raises(Exception, match=" was expected$") as refused:  # the rule's words (run/form_rules.py)
            validate({**deployment.parameters, **bad}, schema, raise_on_error=True)
        assert "made-up" not in str(refused.value) and "has space" not in str(refused.value)  # never the value


def test_a_run_created_from_the_form_is_run_by_a_process_worker(deployed, tmp_path):
    from prefect.utilities.schema_tools import validate

    deployment = _api(deployed, lambda c: c.read_deployment_by_name("grpo_pipeline/local-smoke"))
    # What the UI's form submits: the deployment's values, with the fields a person edited.
    form = {
        **deployment.parameters,
        "run_root": str(tmp_path / "runs"),
        "run_name": "from-the-form",
        "overrides": "\n".join([f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}",
                                "trainer.total_training_steps=2", "trainer.save_freq=2", "eval.max_prompts=8"]),
    }
    validate(form, deployment.parameter_openapi_schema, raise_on_error=True)
    flow_run = _api(deployed, lambda c: c.create_flow_run_from_deployment(deployment.id, parameters=form))

    worker = subprocess.Popen(
        [*PREFECT, "worker", "start", "--pool", "grpo-process", "--work-queue", "local", "--run-once"],
        cwd=REPO, env=deployed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = worker.communicate(timeout=FLOW_RUN_TIMEOUT_S)
    finally:
        worker.kill()
    state = _api(deployed, lambda c: c.read_flow_run(flow_run.id)).state
    assert state.is_completed(), f"{state}\n{output[-6000:]}"
    run_dir = tmp_path / "runs" / "from-the-form"
    assert (run_dir / "report.md").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == "2\n"
