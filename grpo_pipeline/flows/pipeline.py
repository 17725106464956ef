"""The `grpo_pipeline` Prefect flow: the stages in order, each one task, typed values between them.

    python -m grpo_pipeline --model tiny --device cpu --run-name try1

Where the rest lives: each stage's task in tasks/stage_tasks.py (the stage functions themselves in
stages/), retries, limits and caching in tasks/policy.py, what a run has done and the failure
hooks in tasks/run_record.py, and the run's lease (what a killed run left is reaped) in
flows/lease.py. Config errors (`UserError`) are never retried; anything else may be, per stage.
"""

from __future__ import annotations

import time
from pathlib import Path
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.exceptions import TerminationSignal

from grpo_pipeline.cluster.node_tasks import check_shared
from grpo_pipeline.flows import lease
from grpo_pipeline.run import lock as run_lock
from grpo_pipeline.stages.plan import RunPlan, training_command
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.tasks.run_record import RUNS, RunRecord, after_failure, close_cancelled_run
from grpo_pipeline.tasks.stage_tasks import (
    convert_checkpoint_task,
    detect_device_task,
    evaluate_task,
    export_checkpoint_task,
    fetch_dataset_task,
    prepare_checkpoint_task,
    plan_run_task,
    prepare_environment_task,
    report_task,
    resolve_profile_task,
    train_task,
)
from grpo_pipeline.tasks.policy import filter_run_logs, reuse_only_if_intact
from grpo_pipeline.tracking.trackers import FINISHED
from grpo_pipeline.tasks.tracking import open_tracker_run, tracking_lines
from grpo_pipeline.stages.dataset import DatasetFiles, DataSpec, benchmark_specs, dataset_dir
from grpo_pipeline.stages.model import ModelSpec, dist_checkpoint_dir, model_dir, source_digest
from grpo_pipeline.run.folder import RunFolder


# One flow, one plan: `grpo_pipeline` takes a typed request (the command line, with the plan it
# checked; Python callers), `run_from_form` (flows/form.py) the fields a deployment's form shows
# (its deployments and schedules too). Both are the flow `grpo_pipeline` in Prefect, with the same
# failure hooks, and both start with the task `plan_run`: the plan `--dry-run` prints.
FLOW_OPTIONS = dict(name="grpo_pipeline", log_prints=True, on_failure=[after_failure], on_crashed=[after_failure],
                    on_cancellation=[after_failure])


@flow(**FLOW_OPTIONS)
def grpo_pipeline(request: RunRequest, plan: RunPlan | None = None) -> dict:
    """GRPO post-training, from a bare machine to an evaluated checkpoint.

    Args:
        request: What to run: the model recipe, the device, the backend, profile overrides, the
            stages, where the run's files go, and the Ray cluster.
        plan: Leave empty: the flow's first task plans the run (stages/plan.py `plan_run`). The command
            line passes the plan it made with that same function and checked before Prefect started.
    """
    return run_pipeline(request, plan)


def run_pipeline(request: RunRequest, checked: RunPlan | None) -> dict:
    """The flow's body (inside a flow run of either door): the plan first, then the stages, each reading
    its part of the plan."""
    filter_run_logs()
    flow_run_id = get_run_context().flow_run.id
    database = lease.database_of_this_run()
    with lease.held(database):
        lease.note_flow_run(flow_run_id)
        lease.end_leftovers(database, get_run_logger().warning)
        try:
            started = time.perf_counter()
            plan = plan_run_task(request, checked)  # a refusal fails the run here, with its one line
            record = RUNS[flow_run_id] = RunRecord(plan)
            record.timings["plan_run"] = time.perf_counter() - started
            _run_stages(request, record, flow_run_id)
        except TerminationSignal:
            close_cancelled_run(flow_run_id)
            raise
        finally:
            if flow_run_id in RUNS:  # the folder is free for the next run of it (the failure hooks only read it)
                run_lock.release(RUNS[flow_run_id].run_dir)
    RUNS.pop(flow_run_id, None)
    return record.result.shown()


def _run_stages(request: RunRequest, record: RunRecord, flow_run_id: UUID) -> None:
    plan, run_dir, result = record.plan, record.run_dir, record.result
    record.write(RunFolder.PLAN, plan.summary())  # the plan the dry run prints, whichever door the run came in by
    record.run("detect_device", detect_device_task, plan.device)
    if "resolve_profile" in request.stages:
        record.run("resolve_profile", resolve_profile_task, plan.profile, plan.backend_reason, run_dir)
    if "prepare_environment" not in request.stages:
        return
    profile = plan.profile
    env = record.run("prepare_environment", prepare_environment_task, plan.env, run_dir)
    with record.step("open_tracker_run"):  # after planning, before anything is fetched or trained
        tracking = open_tracker_run(profile, plan.device, env.redacted(), run_dir, flow_run_id, get_run_logger().warning)
    if tracking is not None:
        result.tracking = tracking_lines(tracking)
    data = model = policy = None
    benchmarks: dict[str, DatasetFiles] = {}
    if "fetch_dataset" in request.stages:
        with record.step("fetch_dataset"):
            spec = DataSpec.from_profile(profile.data)
        data = result.dataset = _fetch(record, spec)
        with record.step("fetch_dataset: check that every Ray node sees data.root"):
            _log_shared(check_shared(data.path, "data.root", request.ray_address, env.ray_runtime_env()), data.path)
        record.write(RunFolder.DATASET, data.model_dump(mode="json"))
        if "evaluate" in request.stages:  # each benchmark's data, in the same store (data.root)
            with record.step("fetch_dataset: the benchmarks' data"):
                specs = benchmark_specs(profile)
            benchmarks = {name: _fetch(record, spec) for name, spec in specs.items()}
            if benchmarks:
                record.write(RunFolder.BENCHMARKS, {name: files.model_dump(mode="json") for name, files in benchmarks.items()})
    if "prepare_checkpoint" in request.stages:
        with record.step("prepare_checkpoint"):
            spec = ModelSpec.from_profile(profile.model)
            prepare, checked = reuse_only_if_intact(prepare_checkpoint_task, model_dir(spec), spec.source_kind != "local")
        model = record.run("prepare_checkpoint", prepare, spec, profile.model.architecture, checked=checked)
        if spec.dist_checkpoint:
            with record.step("convert_checkpoint"):
                source = source_digest(Path(model.path))
                convert, checked = reuse_only_if_intact(convert_checkpoint_task, dist_checkpoint_dir(spec, Path(model.path)), True)
            dist = record.run("convert_checkpoint", convert, spec, model.path, source, checked=checked)
            model = model.model_copy(update={"dist_checkpoint": dist})
        with record.step("prepare_checkpoint: check that every Ray node sees model.root"):
            _log_shared(check_shared(model.path, "model.root", request.ray_address, env.ray_runtime_env()), model.path)
        record.write(RunFolder.MODEL, model.model_dump(mode="json"))
        result.model = model
    result.command = training_command(request, profile, run_dir, data, model)
    if "train" in request.stages:
        train = result.train = record.run("train", train_task, profile, plan.device, env, data, model, run_dir,
                                          request.ray_address, plan.generation)
        if "export_checkpoint" in request.stages:
            policy = result.policy = record.run("export_checkpoint", export_checkpoint_task, train, run_dir,
                                                profile.eval.checkpoints != "last")
    if "evaluate" in request.stages:
        result.eval = record.run("evaluate", evaluate_task, profile, plan.device, data, model, policy, run_dir,
                                 plan.generation, request.ray_address, env.ray_runtime_env(), benchmarks)
    if "report" in request.stages:
        result.report = str(record.run("report", report_task, record))
    elif result.tracking:  # planning alone: no report, but the tracker runs it opened end too
        record.close_trackers(FINISHED, None, get_run_logger().warning)
    record.write(RunFolder.TIMINGS, record.timings)


def _fetch(record: RunRecord, spec: DataSpec) -> DatasetFiles:
    """A dataset from the store (an earlier run's cached result, while the entry is intact) or fetched."""
    with record.step("fetch_dataset"):
        fetch, checked = reuse_only_if_intact(fetch_dataset_task, dataset_dir(spec), in_store=True)
    return record.run("fetch_dataset", fetch, spec, checked=checked)


def _log_shared(nodes: int | None, path: str) -> None:
    if nodes is not None:
        get_run_logger().info("%s is visible from all %d Ray nodes", path, nodes)
