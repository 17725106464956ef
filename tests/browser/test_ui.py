"""The Prefect UI as a person uses it, in a real headless Chromium: the deployment's custom-run form,
a run submitted from it, its live metrics and rendered report, a run that fails on its profile, and
a cancel from the UI. `GRPO_UI_SCREENSHOTS=<folder>` keeps screenshots of what it saw (docs/ui-*.png)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
RUN_TIMEOUT_S = 900  # a tiny run end to end on a loaded 2-core machine, with the server and browser beside it
FIELDS = ["model", "device", "backend", "overrides", "stages", "run_name", "run_root", "ray_address", "profile_file",
          "trackers"]


def screenshot(page, name: str) -> None:
    if folder := os.environ.get("GRPO_UI_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def field(page, name: str):
    """The form's input for parameter `name` (its label reads the name, then maybe "(Optional)")."""
    label = page.locator(".schema-form-property__label", has_text=name)
    return page.locator(".schema-form-property", has=label).first


def open_form(ui, page):
    deployment = ui["api"](lambda c: c.read_deployment_by_name("grpo_pipeline/local-smoke"))
    page.goto(f"{ui['base']}/deployments/deployment/{deployment.id}/run", wait_until="networkidle")
    field(page, "overrides").locator("textarea").wait_for()
    return deployment


def submit(ui, page, tmp_path: Path, run_name: str, overrides: list[str]):
    """Fill the form as a person would (run name, run root, overrides under the test's folder), submit
    it, and return the flow run the UI created."""
    deployment = open_form(ui, page)
    before = {run.id for run in ui["api"](lambda c: c.read_flow_runs())}
    lines = [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}", *overrides]
    field(page, "overrides").locator("textarea").fill("\n".join(lines))
    field(page, "run_name").locator("textarea").fill(run_name)
    field(page, "run_root").locator("textarea").fill(str(tmp_path / "runs"))
    refused: list[str] = []  # the API's answers the UI took for an error ("Oops. Something went wrong.")
    page.on("response", lambda response: refused.append(f"{response.request.method} {response.url} -> {response.status}")
            if "/api/" in response.url and response.status >= 400 else None)
    page.get_by_role("button", name="Submit").click()
    deadline = time.monotonic() + 180  # the UI creates it in seconds; a loaded 2-core machine took over 60
    while not (new := [run for run in ui["api"](lambda c: c.read_flow_runs()) if run.id not in before]):
        # What the page says then (a field the form refused, a toast with the API's answer), the requests the
        # server refused and its own errors are the lead (twice in ~12 loaded runs the page said only "Oops").
        assert time.monotonic() < deadline, (
            f"the form created no flow run; the page at {page.url} says: "
            + " | ".join(page.inner_text("body").split("\n"))[-2000:] + f"; refused requests: {refused}; the server's "
            f"errors: {server_errors(ui['home'] / 'server.log')}")
        time.sleep(0.5)
    (flow_run,) = new
    assert flow_run.deployment_id == deployment.id
    return flow_run


def server_errors(log: Path) -> str:
    """The error lines of the UI's server log (the exception's last line of each traceback), the last few."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line for line in lines if " ERROR " in line or re.match(r"^\w+(\.\w+)*(Error|Exception)\b", line)]
    return " | ".join(errors[-8:])[-2000:] or "none"


def wait_for_state(ui, flow_run_id, done, timeout_s: float = RUN_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        run = ui["api"](lambda c: c.read_flow_run(flow_run_id))
        if done(run.state):
            return run
        assert time.monotonic() < deadline, f"flow run still {run.state}; worker log:\n" + \
            (ui["home"] / "worker.log").read_text()[-5000:]
        time.sleep(1)


def artifacts_of(ui, flow_run_id) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = ui["api"](lambda c: c.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))
    return {artifact.key: artifact for artifact in found}


def report_of(ui, flow_run_id, timeout_s: float = 600):
    """The run's `run-report` artifact. A failed run's report is published by its on_failure hook,
    which Prefect runs after the Failed state is already visible: wait for it (up to the suite's event
    bound: a cancelled run's hook first ends every process of the run, which once took over 120 s on a
    loaded 2-core CI machine, and over 300 s beside a demo run)."""
    deadline = time.monotonic() + timeout_s
    while "run-report" not in (found := artifacts_of(ui, flow_run_id)):
        assert time.monotonic() < deadline, f"no run-report artifact after {timeout_s:.0f} s: {sorted(found)}"
        time.sleep(1)
    return found["run-report"]


def logs_of(ui, flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = ui["api"](lambda c: c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))))
    return [log.message for log in sorted(logs, key=lambda log: log.timestamp)]


def test_the_form_shows_what_a_person_fills_and_refuses_a_bad_value_before_a_run_exists(ui, page):
    open_form(ui, page)
    screenshot(page, "ui-form")
    labels = [text.strip() for text in page.locator(".schema-form-property__label").all_inner_texts()]
    assert labels == ["model", *(f"{name} (Optional)" for name in FIELDS[1:])]  # model is required, nothing internal
    text = page.inner_text("body")
    assert "plan" not in labels and "request" not in text and 'Property is type' not in text
    runs_before = len(ui["api"](lambda c: c.read_flow_runs()))
    for name, bad in (("overrides", "env.HF_TOKEN=made-up-value-0000"), ("overrides", "trainer.total_training_steps"),
                      ("run_name", "two words")):
        open_form(ui, page)
        field(page, name).locator("textarea").fill(bad)
        page.get_by_role("button", name="Submit").click()
        # The API refuses the run against the deployment's schema; the UI says so in a toast.
        page.get_by_text(f"Validation failed for field '{name}'").first.wait_for()
        if name == "overrides" and "HF_TOKEN" in bad:
            screenshot(page, "ui-form-refused")
    time.sleep(2)
    assert len(ui["api"](lambda c: c.read_flow_runs())) == runs_before  # refused before a run was created


def test_a_run_from_the_form_shows_live_metrics_then_a_report_that_renders(ui, page, tmp_path):
    flow_run = submit(ui, page, tmp_path, "from-the-browser",
                      ["trainer.total_training_steps=6", "trainer.save_freq=3", "eval.max_prompts=8"])
    page.goto(f"{ui['base']}/runs/flow-run/{flow_run.id}", wait_until="networkidle")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while "train-metrics" not in (found := artifacts_of(ui, flow_run.id)) or found["train-metrics"].data.count('"step"') < 3:
        assert time.monotonic() < deadline, "the step metrics table did not grow"
        time.sleep(1)
    page.goto(f"{ui['base']}/artifacts/artifact/{found['train-metrics'].id}", wait_until="networkidle")
    page.get_by_text("reward std").first.wait_for()
    screenshot(page, "ui-train-metrics")

    done = wait_for_state(ui, flow_run.id, lambda state: state.is_final())
    assert done.state.is_completed(), done.state
    artifacts = artifacts_of(ui, flow_run.id)
    rows = artifacts["train-metrics"].data
    assert '"step": 6' in rows and '"reward"' in rows and '"tokens/s"' in rows  # every step, updated in place
    failed_requests = []
    page.on("response", lambda response: failed_requests.append(response.url) if response.status >= 400 else None)
    page.goto(f"{ui['base']}/artifacts/artifact/{artifacts['run-report'].id}", wait_until="networkidle")
    page.get_by_text("Evaluation", exact=True).first.wait_for()
    images = page.evaluate("Array.from(document.images).filter(i => i.src.startsWith('data:')).map(i => [i.alt, i.naturalWidth])")
    # The reward curve, the evaluation plot and the guards' panel, each drawn (a broken image has no width).
    assert len(images) == 3 and all(width > 0 for _, width in images), images
    assert "guards" in [alt for alt, _ in images], images
    assert failed_requests == []
    text = page.inner_text("body")
    assert str(tmp_path / "runs" / "from-the-browser") in text and "beats" in text or "overlap" in text
    screenshot(page, "ui-report")


def test_a_run_that_fails_on_its_profile_says_one_line_and_publishes_its_report(ui, page, tmp_path):
    flow_run = submit(ui, page, tmp_path, "bad-profile", ["trainer.total_training_steps=-3"])
    done = wait_for_state(ui, flow_run.id, lambda state: state.is_final())
    assert done.state.is_failed()
    assert done.state.message.startswith("error: invalid profile: trainer.total_training_steps=-3")
    assert "\n" not in done.state.message
    logs = logs_of(ui, flow_run.id)
    assert not any("Traceback" in line for line in logs), logs
    report = report_of(ui, flow_run.id)
    page.goto(f"{ui['base']}/artifacts/artifact/{report.id}", wait_until="networkidle")
    page.get_by_text("The run failed.").first.wait_for()
    screenshot(page, "ui-failed-report")


def test_a_cancel_from_the_ui_ends_every_process_of_the_run_and_reports_it(ui, page, tmp_path):
    flow_run = submit(ui, page, tmp_path, "cancel-me", ["trainer.total_training_steps=500"])
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (tmp_path / "runs" / "cancel-me" / "metrics.jsonl").is_file():  # training has started
        assert time.monotonic() < deadline, "training never started"
        time.sleep(1)
    worker = psutil.Process(ui["worker"].pid)
    run_processes = worker.children(recursive=True)
    assert run_processes
    page.goto(f"{ui['base']}/runs/flow-run/{flow_run.id}", wait_until="networkidle")
    page.get_by_role("button", name="Cancel").first.click()
    page.get_by_role("button", name="Confirm").click()
    done = wait_for_state(ui, flow_run.id, lambda state: state.is_cancelled(), timeout_s=300)
    gone, alive = psutil.wait_procs(run_processes, timeout=60)
    assert alive == [], [p.info for p in alive]
    report = report_of(ui, flow_run.id)
    assert "was cancelled" in report.description
    task_runs = ui["api"](lambda c: c.read_task_runs())
    train = [run for run in task_runs if run.flow_run_id == flow_run.id and run.name.startswith("train")]
    assert train and all(run.state.is_cancelled() for run in train), \
        f"{[run.state for run in train]}; worker log:\n" + (ui["home"] / "worker.log").read_text()[-5000:]
    logs = logs_of(ui, flow_run.id)
    assert "Finished in state Running()" not in logs and not any(line.startswith("Crash detected") for line in logs), \
        [line[:300] for line in logs if "Crash" in line or "Stopped" in line or "Running()" in line]
    assert done.state.is_cancelled()
