"""The verl backend's Ray-job path on a real 2-node Ray cluster: readiness, submit, follow, cancel, resume.

The cluster is `ray.cluster_utils.Cluster` with its dashboard (the job server) on and one custom `NPU`
on each node (tests/verl_cluster.py); every call goes through Ray's real `JobSubmissionClient`. verl
itself needs GPUs/NPUs and vLLM, so the job runs `tests/verl_stand_in.py` (`trainer.entrypoint`),
which composes the submitted overrides through verl 0.9.1's own Hydra config, joins Ray as main_ppo
does, and writes verl's file-logger JSONL, checkpoints and tracker file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainingInputs, TrainingInterrupted, TrainingRun
from grpo_pipeline.backends.metrics import read_metrics
from grpo_pipeline.backends.verl.backend import JobStopped
from grpo_pipeline.backends.verl.job import JobRecord, job_spec, read_record, write_record
from grpo_pipeline.backends.verl.job_api import submit
from grpo_pipeline.backends.verl.rewards import job_reward_package, pipeline_reward
from grpo_pipeline.checkpoints.hf_shards import HFTensors
from grpo_pipeline.flows.pipeline import grpo_pipeline
from grpo_pipeline.stages.plan import plan_run
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.errors import UserError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.profiles.schema import DataSection
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.stages.environment import resolve_environment
from grpo_pipeline.run.folder import RunFolder
from verl_cluster import CLUSTER, ENTRYPOINT, EVENT_WAIT_S, flow_process, submissions, wait_for

NCCL_TIMEOUT = ("RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return fetch_dataset(DataSpec.from_profile(DataSection(root=str(tmp_path_factory.mktemp("data")))))


def _assert_entrypoints_end(run_dir: Path, within_s: float = EVENT_WAIT_S) -> None:
    """Every entrypoint process the run's jobs started is gone: Ray marks a stopped job STOPPED when
    it has sent SIGTERM, and kills what is left after its stop wait (RAY_JOB_STOP_WAIT_TIME_S, 3 s)."""
    pids = [int(pid) for pid in (run_dir / "stand-in.pids").read_text().split()]
    deadline = time.monotonic() + within_s
    while alive := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, f"entrypoint processes {alive} outlived their stopped job"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Recorder:
    """A `TrainingProgress` that keeps what it was told."""

    def __init__(self):
        self.steps, self.notes, self.warnings, self.lines, self.started_with = [], [], [], [], None
        self.tables = []

    def started(self, max_steps, resumed_from):
        self.started_with = (max_steps, resumed_from)

    def step(self, metrics):
        self.steps.append(metrics.step)

    def note(self, message):
        self.notes.append(message)

    def warn(self, message):
        self.warnings.append(message)

    def output(self, line):
        self.lines.append(line)

    def nodes(self, title, table):
        self.tables.append(table)


def _backend_run(cluster, dataset, tiny_model_dir, tmp_path, name: str, *overrides: str):
    profile = resolve_profile("tiny", "npu", overrides=[*CLUSTER, *overrides])
    run_dir = tmp_path / name
    inputs = TrainingInputs(model_path=str(tiny_model_dir), train_files=dataset.train_files,
                            val_files=dataset.val_files, checkpoint_dir=str(run_dir / "checkpoints"))
    env = resolve_environment(profile, ray_address=cluster.address)
    run = TrainingRun(inputs=inputs, run_dir=str(run_dir), run_name=name, devices_here=0, ray_address=cluster.address,
                      runtime_env=env.ray_runtime_env(), generation=plan_generation(profile))
    return profile, run


def _flow(cluster, stores, tmp_path, name: str, *overrides: str,
          stages=("fetch_dataset", "prepare_checkpoint", "train", "report")):
    """The whole flow for the tiny model on the cluster, with the plan the command line makes (this
    host has no NPU: a run on a cluster is planned for the device the cluster offers), reading the
    session's prepared stores."""
    request = RunRequest(model="tiny", device="npu", backend="verl", run_root=str(tmp_path), run_name=name,
                         ray_address=cluster.address, stages=list(stages), overrides=[*CLUSTER[1:], *stores, *overrides])
    return grpo_pipeline(request, plan_run(request, dry_run=False), return_state=True)


def _train_runs_and_logs(flow_run_id):
    """The flow run's train task runs and log lines, once Prefect has sent the lines it still holds
    (its log worker sends them in batches, in the background)."""
    from grpo_pipeline.flows.local_api import flush_prefect

    flush_prefect()
    return asyncio.run(_read_train_runs_and_logs(flow_run_id))


async def _read_train_runs_and_logs(flow_run_id):
    async with get_client() as client:
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        logs, page = [], None
        while page is None or len(page) == 200:  # the API answers at most 200 at a time; verl's log is longer
            page = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                          limit=200, offset=len(logs))
            logs += page
    return [run for run in task_runs if run.name.startswith("train")], [log.message for log in logs]


def test_a_run_reaches_the_metrics_the_report_and_every_node(prefect_api, cluster, jobs, stores, tmp_path):
    state = _flow(cluster, stores, tmp_path, "full", "env.GRPO_TEST_MARK=on-every-node", "env.STAND_IN_ENV_PROBE=GRPO_TEST_MARK")
    assert state.is_completed(), state.message
    run_dir = tmp_path / "full"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1].reward_mean > records[0].reward_mean and records[0].step_time_s > 0
    assert records[0].response_length == 13.0 and records[0].entropy == pytest.approx(1.9)
    report = (run_dir / "report.md").read_text()
    assert "](reward_curve.png)" in report and (run_dir / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    train = state.result()["train"]
    assert (train["backend"], train["steps_done"], train["max_steps"]) == ("verl", 6, 6)
    assert train["checkpoint_dir"] == str(run_dir / "checkpoints" / "global_step_6")
    # The profile's env reached a process on each node, the second one included, through the job.
    seen = json.loads((run_dir / "stand-in-env.json").read_text())
    assert len(seen) == 2 and all(v == {"GRPO_TEST_MARK": "on-every-node"} for v in seen.values())
    (job,) = submissions(jobs, "full")
    assert job.status == "SUCCEEDED" and job.metadata["attempt"] == "1" and len(job.metadata["profile_hash"]) == 16
    _, logs = _train_runs_and_logs(state.state_details.flow_run_id)
    # The trainer's lines come through Ray from its TaskRunnerV1 actor, prefixed, without Ray's colour
    # codes; each once. (A step's console line, and verl's INFO line in its own format.)
    trainer = re.compile(r"\| \(TaskRunnerV1 pid=\d+\) (?P<line>.*)")
    lines = [found["line"] for line in logs if (found := trainer.fullmatch(line))]
    assert any(line.startswith("step:1 - ") for line in lines), "the job's log is streamed into the task's log"
    assert sum(line.startswith("INFO:") and line.endswith(":Total training steps: 6") for line in lines) == 1
    assert any("backend: verl (--backend verl)" in line for line in logs)
    # Every node's image passed the preflight before the job was submitted; the report shows what they have.
    assert any(line.startswith("preflight: 2 nodes answered in ") and line.endswith("every node can run the train stage")
               for line in logs)
    assert "## Nodes" in report and "| can run train | yes |" in report

    # The run is finished: running it again submits nothing.
    again = _flow(cluster, stores, tmp_path, "full")
    assert again.is_completed() and again.result()["train"]["already_complete"] is True
    assert len(submissions(jobs, "full")) == 1


def test_a_dist_checkpoint_run_trains_exports_and_evaluates_on_the_cluster(prefect_api, cluster, jobs, stores, model_store,
                                                                          tmp_path):
    """`model.dist_checkpoint`: prepare_checkpoint converts the base model into the store, both roles
    load it, the step saved as a dist checkpoint is exported back to HF, and the evaluation runs as
    Ray tasks on the cluster's NPU nodes (the HF engine standing in for vLLM there: no vLLM here), every saved
    step of them (eval.checkpoints=all), each step exported from its dist checkpoint."""
    stages = ("fetch_dataset", "prepare_checkpoint", "train", "export_checkpoint", "evaluate", "report")
    state = _flow(cluster, stores, tmp_path, "dist", "model.dist_checkpoint=true", "eval.max_prompts=6", "eval.max_new_tokens=6",
                  "eval.checkpoints=all", stages=stages)
    assert state.is_completed(), state.message
    result, run_dir = state.result(), tmp_path / "dist"
    dist = result["model"]["dist_checkpoint"]["path"]
    assert dist.startswith(str(model_store)) and (Path(dist) / "manifest.json").is_file()
    (job,) = submissions(jobs, "dist")
    for role in ("actor", "ref"):
        assert f"actor_rollout_ref.{role}.megatron.use_dist_checkpointing=true" in job.entrypoint
        assert f"actor_rollout_ref.{role}.megatron.dist_checkpointing_path={dist}" in job.entrypoint
    step = run_dir / "checkpoints" / "global_step_6" / "actor"
    assert (step / "model" / "dist_ckpt" / ".metadata").is_file() and not list((step / "model" / "huggingface").glob("*.safetensors"))
    assert result["policy"]["path"] == str(step / "huggingface-export")
    base, trained = HFTensors(Path(result["model"]["path"])), HFTensors(step / "huggingface-export")
    assert set(base.where) == set(trained.where) and all(torch.equal(base.get(n), trained.get(n)) for n in base.where)
    evaluation = result["eval"]
    assert evaluation["engine"].startswith(f"transformers (cpu) on {socket.gethostname()} (2 Ray tasks on the cluster)")
    by_name = {m["name"]: m for m in evaluation["models"]}
    assert list(by_name) == ["base", "step_2", "step_4", "step_6"] and all(m["prompts"] == 6 for m in by_name.values())
    assert result["policy"]["steps"] == {str(step): str(run_dir / "checkpoints" / f"global_step_{step}" / "actor" /
                                               "huggingface-export") for step in (2, 4, 6)}
    assert f"Generated with {evaluation['engine']}." in (run_dir / "report.md").read_text()
    # the stand-in does not train: the same weights, greedy, give the same responses, and a tie goes to the earliest step
    assert {Path(m["samples_file"]).read_text() for m in by_name.values()} == {Path(by_name["base"]["samples_file"]).read_text()}
    assert evaluation["best"]["name"] == "step_2" and (run_dir / "best").resolve() == Path(result["policy"]["steps"]["2"])

    # Again: the conversion is a cache hit, checked against the store's manifest.
    again = _flow(cluster, stores, tmp_path, "dist-again", "model.dist_checkpoint=true", stages=stages[:3])
    assert again.is_completed() and again.result()["model"]["dist_checkpoint"]["path"] == dist
    _, logs = _train_runs_and_logs(again.state_details.flow_run_id)
    assert any(line.startswith("convert_checkpoint: skipped") for line in logs)


def test_a_transient_failure_is_retried_and_resumes_from_the_checkpoint(prefect_api, cluster, jobs, stores, tmp_path,
                                                                        monkeypatch):
    import grpo_pipeline.flows.pipeline as pipeline

    # The train stage's retry, 1 s after the failure instead of its policy's 10: the wait is not what is tested.
    monkeypatch.setattr(pipeline, "train_task", pipeline.train_task.with_options(retry_delay_seconds=1))
    state = _flow(cluster, stores, tmp_path, "flaky", "env.STAND_IN_FAIL_AT_STEP=3", f"env.STAND_IN_FAIL_TEXT={NCCL_TIMEOUT}")
    assert state.is_completed(), state.message
    run_dir = tmp_path / "flaky"
    train = state.result()["train"]
    assert (train["steps_done"], train["resumed_from"]) == (6, 2)
    (train_run,), logs = _train_runs_and_logs(state.state_details.flow_run_id)
    assert train_run.run_count == 2
    assert any("(transient: RuntimeError: [Rank 1] Watchdog caught collective operation timeout" in line for line in logs)
    assert any("resuming from checkpoint global_step_2 of 6" in line for line in logs)
    submitted = sorted(submissions(jobs, "flaky"), key=lambda job: job.metadata["attempt"])
    assert [(job.metadata["attempt"], job.status) for job in submitted] == [("1", "FAILED"), ("2", "SUCCEEDED")]
    assert "trainer.resume_mode=auto" in submitted[1].entrypoint
    # Every step once in the run's records, the ones before the failure from the first attempt.
    assert [r.step for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [r.resumed_from for r in read_metrics(run_dir / "metrics.jsonl")][2:] == [2, 2, 2, 2]
    # No checkpoint was deleted: both attempts' steps are there.
    assert {p.name for p in (run_dir / "checkpoints").glob("global_step_*")} == {f"global_step_{n}" for n in (2, 4, 6)}


def test_a_config_error_fails_once_with_the_jobs_own_message(prefect_api, cluster, jobs, stores, tmp_path):
    # A key verl does not have, composed by verl's own Hydra config inside the job.
    state = _flow(cluster, stores, tmp_path, "bad-key", f"{ENTRYPOINT} trainer.no_such_key=1")
    assert state.is_failed()
    message = str(state.message)
    assert "failed on its configuration: " in message and "Could not override 'trainer.no_such_key'." in message, message
    assert "Key 'no_such_key' is not in struct" in message
    (train_run,), _ = _train_runs_and_logs(state.state_details.flow_run_id)
    assert train_run.run_count == 1
    assert [job.status for job in submissions(jobs, "bad-key")] == ["FAILED"]


def test_a_stop_ends_the_job_and_its_entrypoint(cluster, jobs, dataset, tiny_model_dir, gate, tmp_path):
    """What the flow's failure hooks call on a cancel from the UI, SIGTERM or a crash (the job, held after
    its first step by its gate, is still running when it is stopped)."""
    gate.write_text("1")
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, "cancelled", f"env.STAND_IN_GATE={gate}")
    progress, outcome = Recorder(), {}

    def train():
        try:
            backend_for("verl").train(profile, run, progress)
        except Exception as exc:
            outcome["error"] = exc

    trainer = threading.Thread(target=train)
    trainer.start()
    wait_for(lambda: progress.steps or not trainer.is_alive(), "a first step")
    assert progress.steps, (outcome, progress.lines[-5:])
    assert backend_for("verl").stop(Path(run.run_dir)) is True
    trainer.join(timeout=EVENT_WAIT_S)
    record = read_record(Path(run.run_dir))
    assert jobs.get_job_status(record.submission_id) == "STOPPED" and record.status == "STOPPED"
    assert isinstance(outcome["error"], JobStopped)
    _assert_entrypoints_end(Path(run.run_dir))
    assert backend_for("verl").stop(Path(run.run_dir)) is False  # nothing left to stop


def test_a_step_that_never_ends_stops_the_job_and_is_retried(cluster, jobs, dataset, tiny_model_dir, tmp_path):
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, "hung", "env.STAND_IN_STEP_S=60",
                                "trainer.step_timeout_s=3")
    with pytest.raises(TrainingInterrupted, match=r"no training step finished in 3 s \(trainer.step_timeout_s\)"):
        backend_for("verl").train(profile, run, Recorder())
    (job,) = submissions(jobs, "hung")
    assert job.status == "STOPPED"


def test_a_repeated_submit_follows_the_job_already_there(cluster, jobs, dataset, tiny_model_dir, tmp_path):
    """The flow died right after submitting: the next train call follows that job, starts no second one."""
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, "again", "env.STAND_IN_STEP_S=0.5")
    if pipeline_reward(profile):  # what the backend writes before it submits: the job carries the run's reward
        job_reward_package(profile, Path(run.run_dir) / RunFolder.JOB)
    spec = job_spec(profile, run.inputs, Path(run.run_dir), run.run_name, run.runtime_env, "cafe01", 1)
    write_record(Path(run.run_dir), JobRecord(token="cafe01", attempt=1, submission_id=spec.submission_id,
                                              address=jobs.get_address(), metrics_file=spec.metrics_file, status="SUBMITTED"))
    assert submit(jobs, spec) is True
    assert submit(jobs, spec) is False  # "already exists": the same job
    progress = Recorder()
    result = backend_for("verl").train(profile, run, progress)
    assert result.steps_done == 6 and progress.steps == [1, 2, 3, 4, 5, 6]
    assert any("following the run's Ray job grpo-again-cafe01-1 (attempt 1, " in note for note in progress.notes)
    assert [job.submission_id for job in submissions(jobs, "again")] == [spec.submission_id]


@pytest.mark.parametrize("job_record", [False, True])
def test_resume_mode_disable_over_a_runs_checkpoints_is_refused_with_or_without_its_job_record(
        cluster, jobs, dataset, tiny_model_dir, tmp_path, job_record):
    """verl would write over the run's checkpoints; a run that failed (its job record at attempt 3) is no
    exception: only the train stage's own retries resume whatever resume_mode says."""
    name = f"fresh-{job_record}"
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, name, "trainer.resume_mode=disable")
    checkpoints = Path(run.inputs.checkpoint_dir)
    (checkpoints / "global_step_2").mkdir(parents=True)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("2")
    if job_record:
        spec = job_spec(profile, run.inputs, Path(run.run_dir), name, run.runtime_env, "0ld0ne", 3)
        write_record(Path(run.run_dir), JobRecord(token="0ld0ne", attempt=3, submission_id=spec.submission_id,
                                                  address=jobs.get_address(), metrics_file=spec.metrics_file,
                                                  status="FAILED", resumed_from=2))
    with pytest.raises(UserError, match=r"trainer.resume_mode=disable: .* already holds this run's checkpoints \(step 2\)"):
        backend_for("verl").train(profile, run, Recorder())
    assert submissions(jobs, name) == []


@pytest.mark.parametrize(("name", "entrypoint", "cause"), [
    ("no-script", f"{sys.executable} /nonexistent/main_ppo.py", "can't open file '/nonexistent/main_ppo.py'"),
    ("no-module", f"{sys.executable} -m verl.trainer.no_such_main", "No module named verl.trainer.no_such_main"),
    ("no-command", "no-such-trainer", "no-such-trainer: not found"),
])
def test_an_entrypoint_that_cannot_start_fails_once_with_its_cause(cluster, jobs, dataset, tiny_model_dir, tmp_path,
                                                                  name, entrypoint, cause):
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, name, f"trainer.entrypoint={entrypoint}")
    with pytest.raises(UserError) as raised:  # a config error: the train stage does not retry it
        backend_for("verl").train(profile, run, Recorder())
    assert str(raised.value).startswith(f"verl job grpo-{name}-") and " failed on its configuration: " in str(raised.value)
    assert cause in str(raised.value)
    assert [job.status for job in submissions(jobs, name)] == ["FAILED"]


def test_sigterm_to_the_flow_process_stops_the_job(cluster, jobs, stores, gate, tmp_path):
    """A cancel from the UI or a worker, a killed terminal: the flow process gets SIGTERM, Prefect
    runs the run's hooks, and they stop the Ray job (held after its first step by its gate); no
    entrypoint process is left holding devices. The command line, as a user runs it against the
    cluster (with its own local API, as a user's)."""
    gate.write_text("1")
    process = flow_process(cluster.address, tmp_path, "sigterm", f"env.STAND_IN_GATE={gate}",
                           stages="fetch_dataset,prepare_checkpoint,train", stores=stores)
    metrics = tmp_path / "sigterm" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().strip(), "a first step in metrics.jsonl", process=process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=EVENT_WAIT_S)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output
    (job,) = submissions(jobs, "sigterm")
    assert job.status == "STOPPED", output[-3000:]
    assert read_record(tmp_path / "sigterm").status == "STOPPED"
    _assert_entrypoints_end(tmp_path / "sigterm")
    assert "**The run failed.** Stage `train`" in (tmp_path / "sigterm" / "report.md").read_text()


def test_a_run_verl_ends_early_is_complete_and_a_resume_at_its_end_trains_nothing(cluster, jobs, dataset, tiny_model_dir,
                                                                                   tmp_path):
    """verl counts its own steps (after filtering overlong prompts: here 1024 - 976 rows, 6 batches of 8,
    where the file's whole batches make 128). The run it ends is complete; a job resumed at that end
    (its record lost) validates and exits 0 without training: reported as complete from the tracker
    file, never as a 0-step success."""
    profile, run = _backend_run(cluster, dataset, tiny_model_dir, tmp_path, "short", "trainer.total_training_steps=null",
                                "env.STAND_IN_DROP_ROWS=976")
    progress = Recorder()
    result = backend_for("verl").train(profile, run, progress)
    assert (result.steps_done, result.max_steps, result.already_complete) == (6, 6, False)
    assert any("verl ended the run at step 6 of the 128 planned" in warning for warning in progress.warnings)
    assert backend_for("verl").train(profile, run, Recorder()).already_complete
    assert len(submissions(jobs, "short")) == 1

    (Path(run.run_dir) / "verl" / "job.json").unlink()
    progress = Recorder()
    again = backend_for("verl").train(profile, run, progress)
    assert (again.steps_done, again.already_complete, progress.steps) == (6, True, [])
    assert any("already complete at step 6 (verl's tracker file): nothing trained" in note for note in progress.notes)
    assert [job.status for job in submissions(jobs, "short")] == ["SUCCEEDED", "SUCCEEDED"]
