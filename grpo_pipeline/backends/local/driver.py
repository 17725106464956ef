"""The local backend's driver: starts the Ray Train workers, follows their metrics and
checkpoints, and tells a hang or a lost worker from a finished run.

    python -m grpo_pipeline --model tiny --device cpu    # the train stage runs `train_local`

Runs in the flow's process. A step that takes longer than trainer.step_timeout_s is taken for a hang
(a collective that never returns raises nothing): the run's Ray job is ended, which frees the
workers' devices, and `TrainingInterrupted` lets the task's retry resume from the latest checkpoint.
A resume needs its checkpoint's trainer state (where the data stopped), and workers that end without an
error before the last step ended the run short: both are guards (backends/guards.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_pipeline.backends.base import TrainingInterrupted, TrainResult
from grpo_pipeline.backends.guards import GuardTripped, check_data_position, check_short_run
from grpo_pipeline.backends.local.checkpoints import latest_step, missing_data_position
from grpo_pipeline.backends.local.settings import LocalTrainSettings
from grpo_pipeline.backends.metrics import MetricsFollower, StepMetrics, keep_metrics_up_to
from grpo_pipeline.store.file_faults import file_fault
from grpo_pipeline.cluster.ray_cluster import check_room, connect_ray, end_job_actors, stop_ray_job
from grpo_pipeline.errors import UserError
from grpo_pipeline.run.folder import RunFolder

POLL_S = 1.0
# How long Ray Train's `fit` is given to return once the job's actors are killed (it returns within a second).
FIT_END_TIMEOUT_S = 30.0
FIT_THREAD = "ray-train-fit"


def train_local(
    settings: LocalTrainSettings,
    runtime_env: dict | None,
    ray_address: str | None,
    on_step: Callable[[StepMetrics], None] = lambda record: None,
    run_name: str = "grpo",
    on_start: Callable[[int, int | None], None] = lambda max_steps, resumed_from: None,
) -> TrainResult:
    """Train to `settings.max_steps`, resuming from the latest checkpoint; `on_start` hears the planned
    steps and the step resumed from once the run's records are cut back to it, `on_step` sees each
    step's metrics as the workers write them."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from grpo_pipeline.backends.local.worker import worker_loop

    resumed = latest_step(settings.checkpoints)
    complete = resumed is not None and resumed >= settings.max_steps
    if resumed is not None and not complete:
        check_data_position(settings.guards, resumed, missing_data_position(settings.checkpoints, resumed))
    keep_metrics_up_to(settings.metrics_file, resumed or 0)  # the steps after it are trained again
    on_start(settings.max_steps, resumed)
    if complete:
        return partial_result(settings, resumed).model_copy(update={"already_complete": True})
    settings.checkpoints.mkdir(parents=True, exist_ok=True)
    connect_ray(ray_address, runtime_env)
    check_room(settings.platform.ray_worker_resources(settings.cpus_per_worker), settings.workers)
    # On cpu Ray sets each worker's OMP_NUM_THREADS (its torch threads) to the CPUs it was given.
    scaling = settings.platform.ray_train_scaling(settings.cpus_per_worker)
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config=settings.model_dump(),
        scaling_config=ray.train.ScalingConfig(num_workers=settings.workers, **scaling),
        torch_config=TorchConfig(backend=settings.platform.comm_backend),
        # A fresh name per attempt: a reused one would bring back Ray's record of an older run.
        run_config=ray.train.RunConfig(
            name=f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
            storage_path=str(Path(settings.run_dir) / RunFolder.RAY),
            failure_config=ray.train.FailureConfig(max_failures=0),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised below, in the caller's thread
            outcome["error"] = exc

    follower = MetricsFollower(settings.metrics_file)
    runner = threading.Thread(target=fit, name=FIT_THREAD, daemon=True)
    runner.start()
    last_step_at = time.monotonic()
    try:
        while runner.is_alive():
            runner.join(POLL_S)
            for record in follower.new():
                last_step_at = time.monotonic()
                on_step(record)
            if time.monotonic() - last_step_at > settings.step_timeout_s:
                # A hung collective or a stuck worker never raises: this driver's Ray job is ended below,
                # which takes its workers (and their devices) with it, so the retry starts clean.
                raise TrainingInterrupted(
                    f"no training step finished in {settings.step_timeout_s:.0f} s (trainer.step_timeout_s): taken for "
                    f"a hang, workers stopped; the latest checkpoint is step {latest_step(settings.checkpoints) or 0}"
                )
    except BaseException as stopped:
        # Whatever stops the wait (a hang, a guard's trip, SIGTERM, Ctrl-C) is followed by a Ray shutdown (here
        # for a hang; the backend's stop or the flow's failure hook otherwise): `fit` must have returned first,
        # or the shutdown tears Ray's core from under its thread and the process may die by SIGSEGV
        # (end_job_actors says more).
        _end_fit(runner)
        if isinstance(stopped, TrainingInterrupted):
            stop_ray_job()
        raise
    for record in follower.new():
        on_step(record)
    if "error" in outcome:
        raise _as_project_error(outcome["error"], Path(settings.run_dir)) from outcome["error"]
    done = latest_step(settings.checkpoints)
    if done is None or done < settings.max_steps:
        check_short_run(settings.guards, done or 0, settings.max_steps, "TRL's trainer")
        raise TrainingInterrupted(f"the workers stopped at step {done or 0} of {settings.max_steps}")
    return partial_result(settings, done).model_copy(update={"resumed_from": resumed})


def _end_fit(runner: threading.Thread) -> None:
    """Kill the job's actors until Ray Train's `fit` returns (bounded): one that was still starting its
    controller when the hang was called creates it after a first kill."""
    give_up = time.monotonic() + FIT_END_TIMEOUT_S
    while runner.is_alive() and time.monotonic() < give_up:
        end_job_actors()
        runner.join(POLL_S)


def partial_result(settings: LocalTrainSettings, step: int | None) -> TrainResult:
    return TrainResult(
        backend="local",
        checkpoint_dir=str(settings.checkpoints / f"global_step_{step}") if step is not None else "",
        steps_done=step or 0,
        max_steps=settings.max_steps,
        metrics_file=str(settings.metrics_file),
    )


def _as_project_error(error: BaseException, run_dir: Path) -> Exception:
    """A worker's UserError stays one (never retried), a guard that stopped it stays one, and so does an
    OSError no retry can fix (a full disk, a file where the run keeps a folder: store/file_faults.py);
    anything else interrupted training, said by the first worker's own error (Ray's first line names none)."""
    failures = list(getattr(error, "worker_failures", {}).values()) or [error]
    for failure in failures:
        cause = getattr(failure, "cause", failure)
        if isinstance(cause, (UserError, GuardTripped)):
            return cause
        if fault := file_fault(failure, run_dir):
            return fault
    first = getattr(failures[0], "cause", failures[0])
    said = next((line for line in str(first).splitlines() if line.strip()), "")
    return TrainingInterrupted(f"training stopped: {type(first).__name__}: {said[:500]}")
