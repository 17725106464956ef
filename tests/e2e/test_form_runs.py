"""Runs of the deployments' form (flows/form.py) that the run refuses end Failed with one line as the
state's message, and the flow's logs, read back from the Prefect API, hold that line and no traceback.

    pytest tests/e2e/test_form_runs.py

Each run goes the way a worker's process runs a flow run (prefect/engine.py): the flow run is created
in the API with its parameters, then `run_flow` runs it with the flow run's own logger as its
error_logger, which is where Prefect logged `FailedRun` tracebacks after "Finished in state Failed".
The parameters are ones the form's schema lets through (the run checks more) or that only a client
skipping the schema sends; the form's own refusals are tests/test_form.py's.
"""

from __future__ import annotations

import pytest

from grpo_pipeline.flows.form import run_from_form
from grpo_pipeline.run.form_rules import FORM_RULES

pytestmark = pytest.mark.e2e

REFUSED = {
    "bad-profile": ({"overrides": "trainer.total_training_steps=-3", "stages": ["resolve_profile"]},
                    "error: invalid profile: trainer.total_training_steps=-3"),
    "unknown-model": ({"model": "no-such-recipe", "stages": ["resolve_profile"]}, "error: unknown model 'no-such-recipe'"),
    "form-rule": ({"overrides": "env.HF_TOKEN=made-up-9f3e"}, "error: overrides, line 1: a secret-named key holds"),
    "nul-in-run-root": ({"run_root": "runs\x00x"}, "error: run_root: printable characters on one line"),
    "bad-ray-address": ({"ray_address": "head", "stages": ["resolve_profile"]}, "error: ray_address: "),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_form_run_fails_with_one_line_and_logs_no_traceback(prefect_api, tmp_path, case):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.flow_engine import run_flow
    from prefect.logging.handlers import APILogWorker
    from prefect.logging.loggers import flow_run_logger

    fields, message = REFUSED[case]
    parameters = {"model": "tiny", "device": "cpu", "run_root": str(tmp_path / "runs"), **fields}
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(run_from_form, parameters=parameters)
        with pytest.raises(Exception) as ended:  # the engine's caller is told the run failed
            run_flow(run_from_form, flow_run=client.read_flow_run(flow_run.id), error_logger=flow_run_logger(flow_run))
        assert type(ended.value).__name__ == "FailedRun"
        APILogWorker.drain_all(timeout=60)  # what the handler sent is stored before it is read
        state = client.read_flow_run(flow_run.id).state
        logs = [log.message for log in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))]

    assert state.is_failed() and state.message.startswith(message) and "\n" not in state.message, state.message
    assert any(line.startswith(message) for line in logs), logs
    assert not [line for line in logs if "Traceback" in line or "FailedRun" in line or "unexpected exception" in line]
    assert "made-up-9f3e" not in "".join(logs) + state.message


PROBES = {  # the probes that the form stored before, as a client of the API sends them
    "overrides": ["trainer.total_training_steps=2\x0benv.HF_TOKEN=made-up-9f3e", "env={HF_TOKEN: made-up-9f3e}",
                  "env.HF_TOKEN.x=made-up-9f3e", "env.HF-TOKEN=made-up-9f3e", 'env.MIRROR_AUTH="${HF_TOKEN:-made-up-9f3e}"',
                  'data.source="https\\x3a//u:made-up-9f3e@mirror/x"', "trainer={<<: *x, a: made-up-9f3e}",
                  # Issue 44: literal secrets under secret-named keys outside env (each was HTTP 201, stored).
                  "tracking.wandb.api_key=made-up-9f3e", "tracking.mlflow.password=made-up-9f3e",
                  "evn.HF_TOKEN=made-up-9f3e", "env_HF_TOKEN=made-up-9f3e", "hf_token=made-up-9f3e"],
    "model": ["https://u:made-up-9f3e@host/x"],
    "run_root": ["runs\x00made-up-9f3e"],
    "ray_address": ["ray://u:made-up-9f3e@head:10001", "ray://u:made-up-9f3e%40head:10001"],
    "profile_file": ["https://u:made-up-9f3e@host/p.yaml"],
}


def test_the_api_refuses_the_probes_before_storing_a_run_naming_the_field_and_rule_not_the_value(prefect_api):
    """The deployment as `prefect deploy` makes it (its parameter schema enforced): the API answers 409
    naming the field and the rule, and no flow run, nor its parameters, is stored."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    deployment_id = run_from_form.to_deployment(name="form-probes", enforce_parameter_schema=True).apply()
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
        accepted = client.create_flow_run_from_deployment(deployment_id, parameters={
            "model": "tiny", "overrides": 'env.HF_TOKEN="${HF_TOKEN}"  # exported on the worker'})
        assert accepted.parameters["overrides"].startswith("env.HF_TOKEN=")  # what the run accepts, the form does
        for field, values in PROBES.items():
            for value in values:
                with pytest.raises(PrefectHTTPStatusError) as refused:
                    client.create_flow_run_from_deployment(deployment_id, parameters={"model": "tiny", field: value})
                detail = refused.value.response.json()["detail"]
                assert refused.value.response.status_code == 409
                rule = next(rule.says for rule in FORM_RULES[field] if rule.broken(value))
                assert detail == f"Error creating flow run: Validation failed for field '{field}'. Failure reason: {rule!r} " \
                                 "was expected"
                assert "made-up-9f3e" not in detail and len(detail) < 400, detail
        assert len(client.read_flow_runs()) == before + 1  # only the accepted one


def test_a_form_run_and_a_command_line_run_of_one_request_store_the_same_plan(prefect_api, tmp_path):
    """Issue 46, one door: the form planned inside the flow, task by task, so its run stored another plan
    than the command line's. Now both make it with `plan_run` (the form's run in its first task), and
    plan.json is that plan, as `--dry-run --json` prints it. The two runs are of one request, the run's
    folder included (`--run-dir`/`run_root`, `--run-name`/`run_name`): nothing run-specific is left to
    differ, so nothing is excluded and the files must be equal byte for byte. The command line runs
    first, as a person runs it (its own process and Prefect API): the form's run applies the run's
    environment to this process, which a later process would inherit as the user's own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.logging.loggers import flow_run_logger

    root = Path(__file__).resolve().parents[2]
    runs, stores = tmp_path / "runs", [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}"]
    request = ["--model", "tiny", "--device", "cpu", "--run-dir", str(runs), "--run-name", "one-request",
               "--stages", "fetch_dataset", *[part for store in stores for part in ("--set", store)]]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    command_line = [sys.executable, "-m", "grpo_pipeline", *request]
    done = subprocess.run(command_line, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan_file = runs / "one-request" / "plan.json"
    by_command_line = plan_file.read_bytes()
    dry_run = subprocess.run([*command_line, "--dry-run", "--json"], cwd=root, env=env, capture_output=True,
                             text=True, timeout=300)
    # The plan the dry run prints; its device is the one field a dry run leaves unprobed (`--dry-run` plans
    # for a named device without requiring it here), so it is the one field left out of this comparison.
    assert {**json.loads(by_command_line), "device": None} == {**json.loads(dry_run.stdout), "device": None}
    plan_file.unlink()

    parameters = {"model": "tiny", "device": "cpu", "run_root": str(runs), "run_name": "one-request",
                  "stages": ["fetch_dataset"], "overrides": "\n".join(stores)}
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(run_from_form, parameters=parameters)
        run_flow(run_from_form, flow_run=client.read_flow_run(flow_run.id), error_logger=flow_run_logger(flow_run))
        state = client.read_flow_run(flow_run.id).state
        tasks = client.read_task_runs()
    assert state.is_completed(), state.message
    first = min((t for t in tasks if t.flow_run_id == flow_run.id), key=lambda t: t.expected_start_time)
    assert first.name.startswith("plan_run-")  # the form's run planned in its first task
    assert plan_file.read_bytes() == by_command_line
    assert json.loads(by_command_line)["backend"]["name"] == "local"
