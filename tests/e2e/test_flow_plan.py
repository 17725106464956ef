"""The Prefect flow with the stages built so far, under Prefect's test harness (real API, SQLite)."""

from __future__ import annotations

import inspect

import asyncio
import json
import os
import re
import threading
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

from datasets_fixtures import gsm8k_repo_files
from grpo_pipeline.backends.local.driver import FIT_THREAD
from grpo_pipeline.flows.pipeline import grpo_pipeline
from grpo_pipeline.run.request import STAGES, RunRequest
from hub_server import HubServer
from prefect_reads import artifacts


async def _runs(flow_run_id):
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return flow_run, task_runs


def stores(tmp_path) -> list[str]:
    return [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}"]


def test_the_stages_complete_and_write_the_run_files(prefect_api, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_never_written")
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), run_name="plan-1",
                         overrides=["env.HF_TOKEN=${HF_TOKEN}", *stores(tmp_path)])
    state = grpo_pipeline(request, return_state=True)
    assert state.is_completed()
    result = state.result()
    run_dir = tmp_path / "plan-1"
    assert result["run_dir"] == str(run_dir)
    profile = yaml.safe_load((run_dir / "profile.yaml").read_text())
    assert profile["model"]["name"] == "tiny" and profile["platform"]["kind"] == "cpu"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["TOKENIZERS_PARALLELISM"]["value"] == "false"
    assert env["HF_TOKEN"] == {"value": "***", "source": "user"}
    assert env["NO_PROXY"]["source"] == "proxy-policy"  # the default policy, bypass-cluster
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # applied to the driver
    for written in run_dir.rglob("*"):
        assert not written.is_file() or b"hf_never_written" not in written.read_bytes(), written
    planned = json.loads((run_dir / "plan.json").read_text())
    assert planned["backend"]["name"] == "local" and planned["generation"]["engine"] == "transformers"  # decided once, recorded
    assert planned["env"]["HF_TOKEN"] == {"value": "***", "source": "user"}  # the dry run's plan, secrets redacted
    dataset = json.loads((run_dir / "data" / "dataset.json").read_text())
    assert dataset["rows"] == {"train": 1024, "test": 128} and dataset["path"].startswith(str(tmp_path / "data"))
    model = json.loads((run_dir / "model.json").read_text())
    assert model["model_type"] == "qwen3" and model["path"].startswith(str(tmp_path / "models"))
    assert result["dataset"]["train_files"] == dataset["train_files"]
    assert result["train"]["steps_done"] == 8 and (run_dir / "checkpoints" / "latest").read_text() == "8\n"
    assert result["policy"]["path"] == str(run_dir / "checkpoints" / "global_step_8")
    evaluated = {m["name"]: m for m in result["eval"]["models"]}
    assert set(evaluated) == {"base", "trained"} and all(m["prompts"] == 128 for m in evaluated.values())
    assert json.loads((run_dir / "eval" / "eval.json").read_text())["models"][1]["name"] == "trained"
    report = (run_dir / "report.md").read_text()
    assert result["report"] == str(run_dir / "report.md")
    assert "| metric | base | trained | trained - base |" in report and "## Time per stage" in report
    # the generation path, of the rollouts and of the evaluation (the CPU's: eager, dynamic cache)
    assert "Rollouts: transformers generate (dynamic cache, eager decoding, sdpa attention), 1 step(s)' prompts" in report
    assert "Generated with transformers generate (dynamic cache, eager decoding, sdpa attention)." in report
    for image in ("reward_curve.png", "eval_comparison.png"):
        assert f"]({image})" in report and (run_dir / image).read_bytes().startswith(b"\x89PNG")
    for target in re.findall(r"\]\(([^)]+)\)", report):
        assert (run_dir / target).exists(), target  # every link in the report resolves
    assert "hf_never_written" not in report
    # The run's own files are for the team and the Ray nodes: readable, as the umask says (not 0600).
    for written in [*run_dir.glob("*.*"), *run_dir.glob("data/*.json"), *run_dir.glob("eval/*.json")]:
        assert written.stat().st_mode & 0o777 == 0o666 & ~_umask(), written

    flow_run, task_runs = asyncio.run(_runs(state.state_details.flow_run_id))
    stored = json.dumps(flow_run.parameters) + "".join(a.model_dump_json() for a in artifacts(None))
    stored += "".join(log.message for log in asyncio.run(_logs(flow_run.id)))
    assert "hf_never_written" not in stored  # Prefect's database: parameters, artifacts, logs
    for result_file in Path(PREFECT_LOCAL_STORAGE_PATH.value()).rglob("*"):
        assert not result_file.is_file() or b"hf_never_written" not in result_file.read_bytes()
    assert flow_run.state.is_completed()
    assert sorted(t.name.rsplit("-", 1)[0] for t in task_runs) == sorted(["plan_run", *STAGES])
    assert all(t.state.is_completed() for t in task_runs)
    keys = ["fetch-dataset", "prepare-checkpoint", "train", "evaluate"]
    # The newest of each key: a stage the flow retried (Ray's cleaner race, see tests/stage_retry.py) has
    # its failed attempt's bar under the same key, older.
    assert {a.key: a.data for a in artifacts(keys, flow_run.id)} == dict.fromkeys(keys, 100.0)

    # A second run reuses both stages' results from the first (Prefect's cross-run cache) and runs neither.
    again_request = RunRequest(**{**request.model_dump(), "run_name": "plan-2", "stages": ["fetch_dataset", "prepare_checkpoint"]})
    again = grpo_pipeline(again_request, return_state=True)
    assert again.result()["dataset"] == {**result["dataset"], "cached": True} and again.result()["model"]["cached"]
    assert _task_named(again, "fetch_dataset").state.name == "Cached"
    assert _task_named(again, "prepare_checkpoint").state.name == "Cached"
    assert json.loads((tmp_path / "plan-2" / "data" / "dataset.json").read_text())["path"] == dataset["path"]

    # A damaged store entry is not covered by the cache: the stage runs, and repairs it.
    next((tmp_path / "data").rglob("test.parquet")).unlink()
    third = grpo_pipeline(again_request.model_copy(update={"run_name": "plan-3"}), return_state=True)
    assert _task_named(third, "fetch_dataset").state.name == "Completed"
    assert _task_named(third, "prepare_checkpoint").state.name == "Cached"
    assert third.result()["dataset"]["rows"] == {"train": 1024, "test": 128}


async def _logs(flow_run_id):
    async with get_client() as client:
        return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_transient_hub_fault_is_retried_by_the_task_and_a_missing_repo_is_not(prefect_api, tmp_path, monkeypatch):
    with HubServer() as hub:
        hub.add_repo("openai/gsm8k", gsm8k_repo_files())
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        hub.fail("/revision/", "503", times=1)
        request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), stages=["fetch_dataset"],
                             overrides=[*stores(tmp_path), "data.dataset=gsm8k"])
        state = grpo_pipeline(request, return_state=True)
        assert state.is_completed() and state.result()["dataset"]["rows"]["train"] == 12
        fetch = _task_named(state, "fetch_dataset")
        assert fetch.run_count == 2 and fetch.state.is_completed()

        missing = request.model_copy(update={"overrides": [*stores(tmp_path), "data.dataset=gsm8k", "data.source=org/none"],
                                             "run_name": "missing"})
        state = grpo_pipeline(missing, return_state=True)
        assert state.is_failed()
        report = (tmp_path / "missing" / "report.md").read_text()
        assert "**The run failed.** Stage `fetch_dataset`: SourceError: dataset org/none@main" in report
        fetch = _task_named(state, "fetch_dataset")
        assert fetch.run_count == 1 and fetch.state.is_failed()


def _task_named(state, name: str):
    _, task_runs = asyncio.run(_runs(state.state_details.flow_run_id))
    (found,) = [t for t in task_runs if t.name.rsplit("-", 1)[0] == name]
    return found


def test_a_config_error_is_not_retried(prefect_api, tmp_path):
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), overrides=["engine.tpp=1", *stores(tmp_path)])
    state = grpo_pipeline(request, return_state=True)
    assert state.is_failed()
    flow_run, task_runs = asyncio.run(_runs(state.state_details.flow_run_id))
    failed = [t for t in task_runs if t.name.startswith("plan_run")]  # the flow's first task: the plan
    assert len(failed) == 1 and failed[0].run_count == 1 and failed[0].state.is_failed()


def test_a_hung_training_is_stopped_and_the_failure_hook_reports_it_and_ends_the_ray_job(prefect_api, tmp_path, monkeypatch):
    import ray

    from grpo_pipeline.flows import pipeline  # not `import grpo_pipeline...`: that name is the flow's here

    # One attempt: the retries (resuming from the checkpoint) are the kill test's subject, not this one's.
    monkeypatch.setattr(pipeline, "train_task", pipeline.train_task.with_options(retries=0))
    # Ray is stopped only once Ray Train's `fit` has returned: a thread left waiting in Ray while it stopped
    # crashed a later attempt's process (SIGSEGV, in CI).
    threads_at_shutdown = []
    shutdown = ray.shutdown
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: (threads_at_shutdown.append(
        {thread.name for thread in threading.enumerate()}), shutdown(*a, **k))[1])
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), run_name="hung",
                         overrides=[*stores(tmp_path), "trainer.step_timeout_s=1"])
    state = grpo_pipeline(request, return_state=True)
    assert state.is_failed()
    assert not ray.is_initialized()  # the hook ended the run's Ray job, workers included
    assert threads_at_shutdown and not any(FIT_THREAD in names for names in threads_at_shutdown)
    report = (tmp_path / "hung" / "report.md").read_text()
    assert "**The run failed.** Stage `train`: TrainingInterrupted: no training step finished in 1 s" in report
    assert _task_named(state, "train").state.is_failed()


def test_prefect_yaml_entrypoints_resolve():
    from pathlib import Path

    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        loaded = load_flow_from_entrypoint(deployment["entrypoint"])
        assert loaded.name == "grpo_pipeline"
        defaults = {name: p.default for name, p in inspect.signature(loaded.fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        RunRequest.from_form(**{**defaults, **deployment["parameters"]})


def _flip_middle_byte(path) -> None:
    """One byte in the middle, the size unchanged (what bit rot or a stray write does)."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        byte = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert path.stat().st_size == size


def test_a_damaged_store_entry_is_never_served_from_the_cache(prefect_api, tmp_path, monkeypatch):
    """The probe: stage a hub dataset (gsm8k) and the tiny model, flip a byte in the middle of the stored
    train.parquet and model.safetensors, run again: both stages run (not Cached), find the damage and
    build the entries again; a third run with intact entries is served from the cache."""
    from grpo_pipeline.store.content import verify_entry

    with HubServer() as hub:
        hub.add_repo("openai/gsm8k", gsm8k_repo_files())
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), run_name="first",
                             stages=["fetch_dataset", "prepare_checkpoint"], overrides=[*stores(tmp_path), "data.dataset=gsm8k"])
        first = grpo_pipeline(request, return_state=True).result()
        train = next((tmp_path / "data" / "gsm8k").rglob("train.parquet"))
        weights = next((tmp_path / "models").rglob("model.safetensors"))
        _flip_middle_byte(train)
        _flip_middle_byte(weights)
        damaged = grpo_pipeline(request.model_copy(update={"run_name": "damaged"}), return_state=True)
        assert _task_named(damaged, "fetch_dataset").state.name == "Completed"
        assert _task_named(damaged, "prepare_checkpoint").state.name == "Completed"
        result = damaged.result()
        assert not result["dataset"]["cached"] and not result["model"]["cached"]
        assert result["dataset"]["sha256"] == first["dataset"]["sha256"]  # rebuilt to the same content
        assert verify_entry(train.parent, deep=True) == [] and verify_entry(weights.parent, deep=True) == []

        again = grpo_pipeline(request.model_copy(update={"run_name": "again"}), return_state=True)
        assert _task_named(again, "fetch_dataset").state.name == "Cached"
        assert _task_named(again, "prepare_checkpoint").state.name == "Cached"


def test_a_refused_deployment_run_fails_in_its_first_task_before_anything_starts(prefect_api, tmp_path):
    """A run started from a deployment (no CLI planning before it) with a model that does not exist
    fails in its first task, `plan_run`, with the line the command line prints for it, as the command
    line refuses it: before anything is fetched, and before a run folder is made."""
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path), run_name="nope",
                         overrides=[*stores(tmp_path), "model.path=builtin:nope"])
    state = grpo_pipeline(request, return_state=True)
    assert state.is_failed()
    assert "model.path='builtin:nope': no such built-in model" in state.message
    _, task_runs = asyncio.run(_runs(state.state_details.flow_run_id))
    assert [t.name.rsplit("-", 1)[0] for t in task_runs] == ["plan_run"] and task_runs[0].state.is_failed()
    assert not (tmp_path / "nope").exists()  # no run folder: the run never started
    (report,) = [a for a in artifacts(["run-report"]) if a.flow_run_id == state.state_details.flow_run_id]
    assert "**The run failed.** Stage `plan_run`: " in report.data and "no such built-in model" in report.data  # the UI's
    assert not (tmp_path / "data").exists() and not (tmp_path / "models").exists()  # nothing was fetched
