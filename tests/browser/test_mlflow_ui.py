"""A demo run in the MLflow UI, in a real headless Chromium: the run the pipeline logged to a real MLflow
server shows its training metrics, its evaluation, the Prefect flow run it came from and its report.
`GRPO_UI_SCREENSHOTS=<folder>` keeps screenshots of what it saw (docs/ui-mlflow-*.png).

    PYTHONPATH=$PWD python -m pytest -q tests/browser/test_mlflow_ui.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpo_pipeline.tracking.trackers import read_state
from mlflow_server import mlflow_server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
REPO = Path(__file__).resolve().parents[2]


def screenshot(page, name: str) -> None:
    if folder := os.environ.get("GRPO_UI_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`python -m grpo_pipeline --model tiny` logged to a real MLflow server: (server URL, ids)."""
    root = tmp_path_factory.mktemp("mlflow-demo")
    with mlflow_server(root) as url:
        settings = [f"data.root={root / 'data'}", f"model.root={root / 'models'}", "trainer.total_training_steps=6",
                    "eval.max_prompts=16", "tracking.trackers=[mlflow]", f"tracking.mlflow.tracking_uri={url}"]
        env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "TQDM_DISABLE": "1"}
        env.pop("PREFECT_API_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "cpu", "--run-dir", str(root),
             "--run-name", "tiny-demo", *(arg for item in settings for arg in ("--set", item))],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        yield url, read_state(root / "tiny-demo").runs["mlflow"]


def test_the_mlflow_ui_shows_the_demo_run_with_its_metrics_and_report(demo_run, headless_chromium):
    url, ids = demo_run
    run = MlflowClient(url).get_run(ids["run_id"])
    context = headless_chromium.new_context(viewport={"width": 1500, "height": 1300})
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        run_page = f"{url}/#/experiments/{ids['experiment_id']}/runs/{ids['run_id']}"
        page.goto(run_page)
        page.get_by_text("tiny-demo").first.wait_for()
        _hide_assistant(page)
        page.get_by_text("train/reward_mean").first.wait_for()
        page.get_by_text("eval/trained/mean_reward").first.wait_for()
        body = page.inner_text("body")
        assert "prefect.flo" in body and "backend" in body  # the tags naming the flow run, model, device, backend
        assert run.data.tags["prefect.flow_run_id"] and run.data.tags["backend"] == "local"
        page.goto(f"{run_page}/model-metrics")
        page.get_by_placeholder("Search metric charts").fill("train/")
        page.get_by_text("reward_mean").first.wait_for()
        page.wait_for_timeout(3000)  # the charts draw after their data arrives
        screenshot(page, "ui-mlflow-metrics")
        page.goto(f"{run_page}/artifacts")
        page.get_by_text("report.md").first.click()
        page.get_by_role("heading", name="Evaluation").first.wait_for()
        assert "GRPO run" in page.inner_text("body") and "The 95% intervals" in page.inner_text("body")
        screenshot(page, "ui-mlflow-report")
    finally:
        context.close()


def _hide_assistant(page) -> None:
    """MLflow 3.17 opens its assistant beside the run; closed, the run's page has the width."""
    close = page.locator("button[aria-label='Close']")
    if close.count():
        close.first.click()
