"""The verl job path's parts that need no cluster: what is submitted, how a failure is read, how the
log and the metrics are followed (tests/e2e/test_verl_job.py runs them on a real Ray cluster)."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_pipeline.backends.verl import follow, job_api
from grpo_pipeline.backends.verl.steps import planned_steps
from grpo_pipeline.backends.verl.failures import diagnose
from grpo_pipeline.backends.verl.follow import JobLog, VerlMetrics, steps_missing_from, tracker_step
from grpo_pipeline.backends.verl.job import JobRecord, job_spec, submission_id
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.train import training_inputs


@pytest.mark.parametrize(
    ("log", "kind", "line"),
    [
        ("(TaskRunner pid=812, ip=10.0.0.3) [rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective "
         "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600081 milliseconds before "
         "timing out.", "transient", "Watchdog caught collective operation timeout"),
        ("RuntimeError: EI0006: Getting socket times out. Reason: 1. The remote does not initiate a connect request.",
         "transient", "EI0006"),
        ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n\tclass_name: "
         "WorkerDict", "transient", "ActorDiedError"),
        ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.", "transient",
         "node running low on memory"),
        ("The node with node id: 4f2a has been marked dead because the detector has missed too many heartbeats from it.",
         "transient", "marked dead"),
        ("Could not override 'trainer.bogus'.\nTo append to your config use +trainer.bogus=1\nKey 'bogus' is not in "
         "struct\n    full_key: trainer.bogus\n    object_type=dict\n\nSet the environment variable HYDRA_FULL_ERROR=1 "
         "for a complete stack trace.", "config", "Could not override 'trainer.bogus'. Key 'bogus' is not in struct"),
        ("Traceback (most recent call last):\n  File \"main_ppo.py\", line 88\nValueError: Total available GPUs 16 is "
         "less than total desired GPUs 32.", "config", "Total available GPUs 16 is less than total desired GPUs 32"),
        ("Error executing job with overrides: ['a=1']\nTraceback (most recent call last):\nAssertionError: "
         "ppo_mini_batch_size 64 must be divisible by micro batch 3", "config", "AssertionError: ppo_mini_batch_size"),
        ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'verl'", "config",
         "No module named 'verl'"),
        ("/bin/sh: 1: python3: not found", "config", "python3: not found"),
        # trainer.entrypoint naming a script, a module or a command the node lacks
        ("/usr/bin/python3: can't open file '/opt/verl/main_ppo.py': [Errno 2] No such file or directory", "config",
         "can't open file '/opt/verl/main_ppo.py'"),
        ("/usr/bin/python3: No module named verl.trainer.main_ppx", "config", "No module named verl.trainer.main_ppx"),
        ("bash: line 1: torchrun-verl: command not found", "config", "torchrun-verl: command not found"),
        ("loading weights\nKeyError: 'model.layers.0.mlp.gate'\n", "unknown", "KeyError: 'model.layers.0.mlp.gate'"),
    ],
)
def test_a_failed_jobs_log_says_whether_a_retry_can_help(log, kind, line):
    cause = diagnose(log, "Job entrypoint command failed with exit code 1")
    assert cause.kind == kind and line in cause.line


# What a real verl 0.9.1 + vLLM 0.24 start prints before it does anything (the first H200 run): import
# failures that end nothing.
HARMLESS_START = (
    "(TaskRunnerV1 pid=812) WARNING 12-05 11:02:13 [_custom_ops.py:21] Failed to import from vllm._C with "
    "ModuleNotFoundError(\"No module named 'vllm._C'\")\n"
    "(TaskRunnerV1 pid=812) Failed to import megatron: No module named 'megatron'\n"
    "(TaskRunnerV1 pid=812) step:0 - val-core/arith/reward/mean@1:0.17\n")


@pytest.mark.parametrize(
    ("ending", "kind", "line"),
    [
        # The H200 run's end: vLLM could not tell the platform. Retried (the job died of something
        # other than its config) and shown as itself.
        ("Error executing job with overrides: ['trainer.total_training_steps=40']\n"
         "Traceback (most recent call last):\n  File \"verl/trainer/main_ppo.py\", line 47, in main\n"
         "ray.exceptions.RayTaskError(RuntimeError): ray::TaskRunnerV1.run() (pid=812, ip=127.0.0.1)\n"
         "  File \"vllm/platforms/__init__.py\", line 280, in __getattr__\n"
         "RuntimeError: Failed to infer device type\n"
         "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
         "unknown", "RuntimeError: Failed to infer device type"),
        # A package the image lacks, raised and ending the job: a config (image) error, not retried.
        ("Traceback (most recent call last):\n  File \"xgrammar/exception.py\", line 3\n"
         "ModuleNotFoundError: No module named 'tvm_ffi'", "config", "No module named 'tvm_ffi'"),
        # Hydra's full error (HYDRA_FULL_ERROR=1, which launch scripts for verl often export, or any tracer: Hydra takes
        # coverage or a debugger for "under a debugger"): the chained cause, then Hydra's own exception. Frames'
        # source lines (`raise ConfigCompositionException(`) are code, not what went wrong.
        ("Traceback (most recent call last):\n  File \"omegaconf/dictconfig.py\", line 164, in _validate_get\n"
         "    self._format_and_raise(\nomegaconf.errors.ConfigAttributeError: Key 'bogus' is not in struct\n"
         "    full_key: trainer.bogus\n    object_type=dict\n\nThe above exception was the direct cause of the "
         "following exception:\n\nTraceback (most recent call last):\n  File \"hydra/_internal/config_loader_impl.py\", "
         "line 392, in _apply_overrides_to_config\n    raise ConfigCompositionException(\n"
         "hydra.errors.ConfigCompositionException: Could not override 'trainer.bogus'.\n"
         "To append to your config use +trainer.bogus=1", "config",
         "ConfigAttributeError: Key 'bogus' is not in struct hydra.errors.ConfigCompositionException: Could not override "
         "'trainer.bogus'."),
        ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'a'\n\nDuring handling of the "
         "above exception, another exception occurred:\n\nTraceback (most recent call last):\n"
         "ImportError: cannot import name 'x'", "unknown", "ImportError: cannot import name 'x'"),
    ],
)
def test_the_job_is_judged_by_the_exception_that_ended_it_not_by_any_line(ending, kind, line):
    cause = diagnose(HARMLESS_START + ending, "Job entrypoint command failed with exit code 1")
    assert cause.kind == kind and line in cause.line and "vllm._C" not in cause.line


def test_an_import_failure_in_the_chain_that_ended_the_job_counts():
    log = HARMLESS_START + ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'verl'\n\n"
                            "The above exception was the direct cause of the following exception:\n\n"
                            "Traceback (most recent call last):\nRuntimeError: the entrypoint could not start")
    assert diagnose(log) == ("config", "ModuleNotFoundError: No module named 'verl'")


def test_a_lost_node_wins_over_the_assertion_it_caused():
    log = "AssertionError: batch size mismatch\nray.exceptions.NodeDiedError: Task failed because node 10.0.0.4 died"
    assert diagnose(log).kind == "transient"


class ReplayingTail:
    """Ray's log tail: every connection replays the log from its start; the first one drops mid-way."""

    def __init__(self, log: str):
        self.log, self.connections = log, 0

    async def tail_job_logs(self, job_id):
        self.connections += 1
        cut = 25 if self.connections == 1 else len(self.log)
        for start in range(0, cut, 7):  # chunks that split lines
            yield self.log[start:min(start + 7, cut)]
        if self.connections == 1:
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")


def test_the_log_tail_passes_each_line_once_across_reconnects(monkeypatch):
    monkeypatch.setattr(follow, "RECONNECT_S", 0.01)
    text = "".join(f"line {n} of the job\n" for n in range(1, 9)) + "partial"
    tail = ReplayingTail(text)
    log = JobLog(tail, "grpo-run-abc-1")
    deadline, seen = time.monotonic() + 10, []
    while len(seen) < 8 and time.monotonic() < deadline:
        seen += log.lines()
        time.sleep(0.01)
    assert tail.connections >= 2
    assert seen == [f"line {n} of the job" for n in range(1, 9)]
    # After the job ended: its whole log, of which only what the tail missed is new. A progress bar's
    # redraws (carriage returns) leave the line as it was last drawn.
    ended = text + " line, ended\nTraining Progress:  50%|#  | 1/2\rTraining Progress: 100%|##| 2/2\r\n"
    assert log.finish(ended) == ["partial line, ended", "Training Progress: 100%|##| 2/2"]


def _write(path: Path, *records: dict, partial: str = "") -> None:
    with open(path, "a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
        handle.write(partial)


def test_verl_file_logger_records_become_the_runs_step_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    step = {"critic/score/mean": 0.25, "response_length/mean": 10.0, "timing_s/step": 2.0, "actor/pg_loss": -0.1,
            "actor/entropy": 1.5, "actor/kl_loss": 0.01, "actor/lr": 1e-6, "perf/throughput": 900.0, "note": "text"}
    _write(path, {"step": 4, "data": {"val-core/geo3k/reward/mean@1": 0.2}},  # validation before the attempt's first step
           {"step": 5, "data": step}, partial='{"step": 6, "data": {"critic/sc')
    metrics = VerlMetrics(path, after_step=4, responses_per_step=8, resumed_from=4)
    (record,) = metrics.new()
    assert (record.step, record.reward_mean, record.kl, record.loss, record.entropy) == (5, 0.25, 0.01, -0.1, 1.5)
    assert record.tokens_per_s == 10.0 * 8 / 2.0 and record.step_time_s == 2.0 and record.learning_rate == 1e-6
    assert record.resumed_from == 4
    _write(path, partial='ore/mean": 0.5, "timing_s/step": 1.0}}\n')
    assert [(r.step, r.reward_mean, r.kl) for r in metrics.new()] == [(6, 0.5, None)]
    assert metrics.new() == []


def _attempt_file(path: Path, resumed_from: int, last: int) -> Path:
    """verl's file of an attempt: its validation at the step it resumed from, then its training steps."""
    _write(path, {"step": resumed_from, "data": {"val-core/arith/reward/mean@1": 0.1}},
           *({"step": n, "data": {"critic/score/mean": n / 10, "timing_s/step": 1.0}}
             for n in range(resumed_from + 1, last + 1)))
    return path


def test_the_steps_a_killed_flow_never_read_come_from_the_attempt_that_trained_them_last(tmp_path):
    # Attempt 1 trained steps 1-7 and failed (its checkpoint: step 4); attempt 2 resumed from 4 and
    # trained 5-9. The run's own records stopped at step 2 when its flow was killed.
    first = _attempt_file(tmp_path / "metrics-grpo-run-c0ffee-1.jsonl", 0, 7)
    second = _attempt_file(tmp_path / "metrics-grpo-run-c0ffee-2.jsonl", 4, 9)
    recorded = VerlMetrics(first, None, 8, None).new()[:2]
    missing = steps_missing_from(recorded, [first, second], 4, 8)
    assert [(r.step, r.resumed_from, r.reward_mean) for r in missing] == [
        (3, None, 0.3), (4, None, 0.4), (5, 4, 0.5), (6, 4, 0.6), (7, 4, 0.7), (8, 4, 0.8), (9, 4, 0.9)]
    assert steps_missing_from([*recorded, *missing], [first, second], 4, 8) == []
    # Attempt 2 submitted, its file not written yet: attempt 1's steps after its resume point are not the run's.
    second.write_text("")
    assert [r.step for r in steps_missing_from(recorded, [first, second], 4, 8)] == [3, 4]
    second.unlink()
    assert [r.step for r in steps_missing_from(recorded, [first, second], None, 8)] == []


def test_the_job_record_names_every_attempts_metrics_file(tmp_path):
    record = JobRecord(token="c0ffee", attempt=3, submission_id="grpo-my-run-2-c0ffee-3", address="http://head:8265",
                       metrics_file=str(tmp_path / "metrics-grpo-my-run-2-c0ffee-3.jsonl"))
    assert [path.name for path in record.attempt_metrics_files()] == [
        f"metrics-grpo-my-run-2-c0ffee-{n}.jsonl" for n in (1, 2, 3)]


@pytest.mark.parametrize(("entrypoint", "problem"), [
    ("python3 -m 'verl.trainer.main_ppo", "no closing quotation; close the quote"),
    ("   ", "trainer.entrypoint is empty"),
])
def test_an_entrypoint_that_is_not_a_command_is_refused_when_the_profile_is_resolved(entrypoint, problem):
    with pytest.raises(ProfileError, match=problem):
        resolve_profile("tiny", "npu", "verl", overrides=[f"trainer.entrypoint={entrypoint}"])


class HeadWithoutAgentYet:
    """Ray's job API on a head whose job agent registers late: its first answers are Ray's HTTP 500."""

    def __init__(self, refusals: int):
        self.refusals, self.submitted = refusals, []

    def submit_job(self, **job):
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try "
                               "again later..")
        if job["submission_id"] in self.submitted:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {job['submission_id']} "
                               "already exists.")
        self.submitted.append(job["submission_id"])


def test_a_submit_waits_for_the_heads_job_agent(monkeypatch, tmp_path):
    monkeypatch.setattr(job_api, "AGENT_RETRY_S", 0.01)
    profile = resolve_profile("tiny", "npu", "verl")
    spec = job_spec(profile, training_inputs(profile, tmp_path), tmp_path, "run", {}, "c0ffee", 1)
    head = HeadWithoutAgentYet(refusals=3)
    assert job_api.submit(head, spec) is True and head.submitted == [spec.submission_id]
    assert job_api.submit(head, spec) is False  # the same job: followed, not submitted twice


def test_a_head_whose_agent_never_comes_is_named_in_one_line_with_the_port_it_may_have_lost(monkeypatch, tmp_path):
    """Issue 44: beside another Ray, the head's agent found its port taken and never registered; the
    tests waited out 300 s and failed on Ray's own message."""
    monkeypatch.setattr(job_api, "AGENT_RETRY_S", 0.01)
    monkeypatch.setenv("GRPO_PIPELINE_RAY_CONNECT_TIMEOUT_S", "0.2")
    profile = resolve_profile("tiny", "npu", "verl")
    spec = job_spec(profile, training_inputs(profile, tmp_path), tmp_path, "run", {}, "c0ffee", 1)
    with pytest.raises(job_api.ClusterNotReady) as refused:
        job_api.submit(HeadWithoutAgentYet(refusals=10**6), spec)
    message = str(refused.value)
    assert "\n" not in message and "port (52365 unless given)" in message
    assert "start the head with --dashboard-agent-listen-port=0" in message


def test_the_tracker_names_a_step_only_once_its_folder_exists(tmp_path):
    assert tracker_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert tracker_step(tmp_path) is None
    (tmp_path / "global_step_4").mkdir()
    assert tracker_step(tmp_path) == 4


def test_a_retry_always_resumes_into_the_same_checkpoints_under_its_own_id(tmp_path):
    profile = resolve_profile("qwen3.5-35b-a3b", "gpu", overrides=["trainer.resume_mode=disable"])
    inputs = training_inputs(profile, tmp_path / "my run")
    first = job_spec(profile, inputs, tmp_path / "my run", "my run/1", {"env_vars": {"A": "1"}}, "c0ffee", 1)
    second = job_spec(profile, inputs, tmp_path / "my run", "my run/1", {"env_vars": {"A": "1"}}, "c0ffee", 2)
    assert (first.submission_id, second.submission_id) == ("grpo-my-run-1-c0ffee-1", "grpo-my-run-1-c0ffee-2")
    assert "trainer.resume_mode=disable" in shlex.split(first.entrypoint)
    assert "trainer.resume_mode=auto" in shlex.split(second.entrypoint)
    dirs = {arg for spec in (first, second) for arg in shlex.split(spec.entrypoint) if "default_local_dir" in arg}
    assert dirs == {f'trainer.default_local_dir="{tmp_path / "my run" / "checkpoints"}"'}  # quoted for Hydra
    assert first.metrics_file != second.metrics_file  # verl opens its file logger with "wb"
    assert second.runtime_env["env_vars"] == {"A": "1", "VERL_FILE_LOGGER_PATH": second.metrics_file}
    assert submission_id("x" * 200, "c0ffee", 1) == f"grpo-{'x' * 80}-c0ffee-1"


def test_the_planned_steps_follow_verls_count(tmp_path):
    train = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["p"] * 300}), train)
    profile = resolve_profile("tiny", "npu", "verl", overrides=["trainer.total_epochs=3", "trainer.total_training_steps=null"])
    assert planned_steps(profile, [str(train)]) == 300 // 8 * 3  # whole batches of 8 (verl drops the last one)
    assert planned_steps(profile.model_copy(update={"trainer": profile.trainer.model_copy(
        update={"total_training_steps": 5})}), [str(train)]) == 5
