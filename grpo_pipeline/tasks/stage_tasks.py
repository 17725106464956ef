"""Each stage as a Prefect task: the plain stage function (stages/), its row of `STAGE_SETTINGS`,
and what the run shows of it (log lines, artifacts, the run folder's JSON).

    python -m grpo_pipeline --model tiny --device cpu --stages evaluate

The stage functions never import Prefect, so planning a run (the command line, a dry run) stays
fast and the command line can start Prefect's API before Prefect is imported.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainResult
from grpo_pipeline.backends.guards import GuardTripped
from grpo_pipeline.backends.metrics import StepMetrics
from grpo_pipeline.store.files import write_json_atomic, write_text_atomic
from grpo_pipeline.progress import Bar
from grpo_pipeline.stages.plan import RunPlan, plan_run
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.tasks.run_record import RunRecord, write_run_report
from grpo_pipeline.tasks.policy import CACHED_ACROSS_RUNS, StepTable, progress_artifact, stage_task
from grpo_pipeline.tracking.trackers import FINISHED
from grpo_pipeline.tasks.tracking import StepTracking, tell_trackers
from grpo_pipeline.generation.engines import engine_label
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.profiles.schema import ModelArchitecture, RunProfile
from grpo_pipeline.stages.dataset import DatasetFiles, DataSpec, fetch_dataset
from grpo_pipeline.stages.device import DeviceInfo
from grpo_pipeline.stages.environment import RuntimeEnv
from grpo_pipeline.profiles.evaluation import HELDOUT
from grpo_pipeline.stages.evaluate import EvalReport, EvalSettings, checkpoint_name, evaluate
from grpo_pipeline.stages.export import ExportedPolicy, export_checkpoint, mark_best
from grpo_pipeline.stages.model import DistCheckpoint, ModelCheckpoint, ModelSpec, prepare_dist_checkpoint, prepare_model
from grpo_pipeline.stages.benchmark_report import benchmark_tables
from grpo_pipeline.stages.train import train
from grpo_pipeline.run.folder import RunFolder


@stage_task("plan_run")
def plan_run_task(request: RunRequest, checked: RunPlan | None = None) -> RunPlan:
    """The flow's first task, whichever door the run came in by: `plan_run`, or the plan the command line made
    with it and checked before Prefect started (planning again would detect the device and check the
    rewards and the hub twice)."""
    return checked or plan_run(request)


@stage_task("detect_device")
def detect_device_task(device: DeviceInfo) -> DeviceInfo:
    get_run_logger().info("device: %s (%s)", device.kind, device.reason)
    return device


@stage_task("resolve_profile")
def resolve_profile_task(profile: RunProfile, backend_reason: str, run_dir: Path) -> RunProfile:
    get_run_logger().info("backend: %s (%s)", profile.backend, backend_reason)
    write_text_atomic(run_dir / RunFolder.PROFILE, yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return profile


@stage_task("prepare_environment")
def prepare_environment_task(env: RuntimeEnv, run_dir: Path) -> RuntimeEnv:
    env.check_references()
    # The driver is the process that starts Ray and the backends; they inherit it from here.
    env.apply()
    for action in env.proxy_actions:
        get_run_logger().info("proxy policy %s: %s", env.proxy_policy, action)
    redacted = env.redacted()
    write_json_atomic(run_dir / RunFolder.ENV, redacted)
    rows = "\n".join(f"| `{name}` | `{item['value']}` | {item['source']} |" for name, item in redacted.items())
    rows += "\n\n" + "\n".join(f"- proxy policy `{env.proxy_policy}`: {action}" for action in env.proxy_actions)
    create_markdown_artifact(
        key="run-environment",
        markdown=f"| variable | value | source |\n|---|---|---|\n{rows}\n",
        description="Environment of every process of the run (secrets redacted)",
    )
    return env


@stage_task("fetch_dataset", **CACHED_ACROSS_RUNS)
def fetch_dataset_task(spec: DataSpec) -> DatasetFiles:
    logger = get_run_logger()
    with progress_artifact("fetch-dataset", f"dataset {spec.dataset} from {spec.source}"):
        files = fetch_dataset(spec, log=logger.warning)
    logger.info(
        "dataset %s: %s, rows %s, at %s",
        spec.dataset, "in the store, verified" if files.cached else "fetched and verified", files.rows, files.path,
    )
    return files


@stage_task("prepare_checkpoint", **CACHED_ACROSS_RUNS)
def prepare_checkpoint_task(spec: ModelSpec, architecture: ModelArchitecture) -> ModelCheckpoint:
    logger = get_run_logger()
    with progress_artifact("prepare-checkpoint", f"base model {spec.source}"):
        checkpoint = prepare_model(spec, architecture, log=logger.warning)
    logger.info(
        "base model %s: %s, %s parameters, at %s", spec.source,
        "in the store, verified" if checkpoint.cached else "prepared and verified",
        f"{checkpoint.num_parameters:,}", checkpoint.path,
    )
    return checkpoint


@stage_task("convert_checkpoint", **CACHED_ACROSS_RUNS)
def convert_checkpoint_task(spec: ModelSpec, model_path: str, source: str) -> DistCheckpoint:
    """`source` (the HF weights' digest) is in the cache key: other weights at the same path convert again."""
    logger = get_run_logger()
    with progress_artifact("convert-checkpoint", f"dist checkpoint of {spec.source}"):
        dist = prepare_dist_checkpoint(spec, Path(model_path), log=logger.warning)
    logger.info("dist checkpoint of %s: %s, at %s", spec.source,
                "in the store, verified" if dist.cached else "converted and verified", dist.path)
    return dist


class StepLog:
    """The train stage's `TrainingProgress`: a log line per step, a terminal bar (and through it the
    Prefect progress artifact `train`), and the Prefect table artifact `train-metrics`, one row per step,
    updated in place as training goes."""

    def __init__(self, run_dir: Path, tracking: StepTracking | None = None) -> None:
        self.logger, self.bar, self.max_steps = get_run_logger(), None, 0
        self.table = StepTable(run_dir / RunFolder.METRICS)
        self.tracking = tracking

    def started(self, max_steps: int, resumed_from: int | None) -> None:
        self.max_steps = max_steps
        if resumed_from:
            self.logger.info("resuming from checkpoint global_step_%d of %d", resumed_from, max_steps)
        self.bar = Bar(total=max_steps, initial=resumed_from or 0, desc="GRPO steps", unit="step")
        self.bar.set_postfix_str("starting: the workers load the model", refresh=True)
        self.table.show()

    def step(self, metrics: StepMetrics) -> None:
        self.bar.set_postfix_str(f"reward {metrics.reward_mean:.3f}", refresh=False)
        self.bar.update(metrics.step - self.bar.n)
        self.logger.info(metrics.log_line(self.max_steps))
        self.table.show()
        if self.tracking is not None:
            self.tracking.step(metrics)

    def note(self, message: str) -> None:
        self.logger.info(message)

    def warn(self, message: str) -> None:
        self.logger.warning(message)

    def output(self, line: str) -> None:
        self.logger.info("| %s", line)

    def nodes(self, title: str, table: list[str]) -> None:
        create_markdown_artifact(key="node-images", markdown="\n".join(table) + "\n", description=title)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.table.show(final=True)
        if self.tracking is not None:
            self.tracking.close()


@stage_task("train")
def train_task(
    profile: RunProfile, device: DeviceInfo, env: RuntimeEnv, data: DatasetFiles, model: ModelCheckpoint,
    run_dir: Path, ray_address: str | None, generation: GenerationPlan,
) -> TrainResult:
    logs_itself = backend_for(profile.backend).logs_to_trackers
    progress = StepLog(run_dir, StepTracking(profile, run_dir, logs_itself, get_run_logger().warning))
    stopped_by = None
    try:
        with progress_artifact("train", f"GRPO {profile.model.name} ({profile.world_size} workers)"):
            return train(profile, device, env, data, model, run_dir, ray_address, progress, generation)
    except GuardTripped as tripped:
        stopped_by = tripped.trip
        raise
    finally:
        progress.close()
        if stopped_by is not None:  # after the steps' session: the trackers hear of it at its step
            tell_trackers(profile, run_dir, stopped_by, get_run_logger().warning)


@stage_task("export_checkpoint")
def export_checkpoint_task(train: TrainResult, run_dir: Path, every_step: bool = False) -> ExportedPolicy:
    policy = export_checkpoint(train, every_step)
    get_run_logger().info("trained policy (step %d) verified: %s", policy.step, policy.path)
    if len(policy.steps) > 1:
        get_run_logger().info("saved steps %s exported and verified for the evaluation", sorted(policy.steps))
    write_json_atomic(run_dir / RunFolder.POLICY, policy.model_dump(mode="json"))
    return policy


@stage_task("evaluate")
def evaluate_task(
    profile: RunProfile, device: DeviceInfo, data: DatasetFiles, model: ModelCheckpoint,
    policy: ExportedPolicy | None, run_dir: Path, generation: GenerationPlan, ray_address: str | None = None,
    runtime_env: dict | None = None, benchmarks: dict[str, DatasetFiles] | None = None,
) -> EvalReport:
    """Where the models generate is the backend's choice (`Backend.evaluation`): a verl run's policy
    is too big for this host and is evaluated on its cluster; any other run here, on this host's devices."""
    logger = get_run_logger()
    section = profile.eval
    checkpoints = {step: Path(path) for step, path in policy.steps.items()} if policy and section.checkpoints != "last" else {}
    if section.models:
        models = {Path(path).name: Path(path).expanduser() for path in section.models}
    else:
        models = {"base": Path(model.path)} | ({"trained": Path(policy.path)} if policy and not checkpoints else {})
    files = {name: Path((benchmarks or {})[name].val_files[0] if name != HELDOUT else data.val_files[0])
             for name in section.benchmarks}
    settings, engine = backend_for(profile.backend).evaluation(
        profile, EvalSettings.from_profile(profile, generation), device.count, ray_address, runtime_env or {})
    with progress_artifact("evaluate", f"evaluate {', '.join([*models, *map(checkpoint_name, checkpoints)])} on "
                                       f"{', '.join(files)}"):
        logger.info("generation: %s", engine_label(engine, settings))
        report = evaluate(models, files, settings, run_dir / RunFolder.EVAL, engine, checkpoints, section.checkpoints,
                          section.selection(), logger.info)
        logger.info("generated with: %s", report.engine)
    for metrics in report.models:
        logger.info(metrics.summary_line())
    write_json_atomic(run_dir / RunFolder.EVAL_REPORT, report.model_dump(mode="json"))
    if report.best is not None:
        mark_best(run_dir, report.best)
        logger.info(report.best.line())
    create_markdown_artifact(key="evaluation", markdown=benchmark_tables(report.model_dump(mode="json")) + "\n",
                             description=f"Evaluation on {', '.join(files)}")
    return report


@stage_task("report")
def report_task(record: RunRecord) -> Path:
    logger = get_run_logger()
    path, markdown = record.close_trackers(FINISHED, lambda: write_run_report(record), logger.warning)
    create_markdown_artifact(key="run-report", markdown=markdown, description=f"Report of run {record.run_dir.name}")
    logger.info("report: %s", path)
    if tracking := record.result.tracking:
        logger.info("tracker runs: %s", "; ".join(f"{k}: {v}" for k, v in tracking.items()))
    return path
