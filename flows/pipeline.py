"""The `grpo_pipeline` Prefect flow: thin task wrappers around the plain stage functions.

    python -m flows.grpo --model tiny --device cpu --run-name try1

Each stage is one task and hands the next a typed value. Config errors (`UserError`) are never
retried; anything else may be, per stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.context import get_run_context
from prefect.logging import get_logger
from prefect.tasks import exponential_backoff

from backends.local import TrainResult, check_prompt_lengths, latest_step, plan_local_training, train_local
from flows import lease
from flows.plan import check_plan, check_run_dir, profile_for, run_dir_for, training_command
from flows.request import RunRequest
from profiles.errors import UserError
from profiles.secrets import scrub, secret_values
from profiles.schema import ModelArchitecture, RunProfile
from stages.dataset import DatasetFiles, DataSpec, dataset_dir, fetch_dataset
from stages.device import DeviceInfo, detect_device, requested_device
from stages.environment import RuntimeEnv, resolve_environment
from stages.evaluate import EvalReport, EvalSettings, choose_engine, evaluate
from stages.export import MERGE_TIMEOUT_S, ExportedPolicy, export_checkpoint
from common.files import write_json_atomic, write_text_atomic
from stages.model import ModelCheckpoint, ModelSpec, model_dir, prepare_model
from common.ray_cluster import check_visible_on_nodes, connect_ray, stop_ray_job
from common.progress import Bar, reporting_to
from stages.report import write_report
from common.store import fingerprint, verify_entry, what_is_checked

# Task settings, per stage. Every stage fails at once on a config error (`retry_unless_user_error`).
# Prefect's `timeout_seconds` interrupts a stage that runs in the flow's main thread (it uses
# SIGALRM); work that blocks elsewhere carries its own limit: the device probe and the checkpoint
# merge are subprocesses with timeouts, hub transfers time out per read (huggingface_hub), and a
# training step that never ends is caught by `trainer.step_timeout_s`.
HOUR = 3600
# Downloads: 4 retries after 2, 4, 8, 16 s (each +-50% jitter), so a mirror's bad minute passes.
FETCH_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.5)
STAGE_SETTINGS: dict[str, dict] = {
    "detect_device": dict(retries=1, retry_delay_seconds=2, timeout_seconds=300),
    "resolve_profile": dict(timeout_seconds=120),
    "prepare_environment": dict(timeout_seconds=120),
    "fetch_dataset": dict(**FETCH_RETRIES, timeout_seconds=2 * HOUR),
    # 244 GB of weights at 100 MB/s is 40 min; a slow mirror may take hours.
    "prepare_checkpoint": dict(**FETCH_RETRIES, timeout_seconds=12 * HOUR),
    # A lost worker, node or collective is retried twice, resuming from the latest checkpoint. No
    # wall-clock limit: a run may take days; a hang is a step that never ends.
    "train": dict(retries=2, retry_delay_seconds=10),
    "export_checkpoint": dict(retries=1, retry_delay_seconds=10, timeout_seconds=MERGE_TIMEOUT_S + 600),
    "evaluate": dict(retries=1, retry_delay_seconds=10, timeout_seconds=6 * HOUR),
    "report": dict(timeout_seconds=300),
}
PROGRESS_UPDATE_S = 1.0


class RunLogFilter(logging.Filter):
    """On every handler of the run's logs (the terminal, and Prefect's API, which stores them): a
    user error is reported by its one-line message (Prefect would log its traceback, which only
    buries the line that says what to fix), and no secret value of this process reaches a line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        values = secret_values()
        if values:
            record.msg, record.args = scrub(record.getMessage(), values), ()
            if record.exc_info and not record.exc_text:
                record.exc_text = scrub(logging.Formatter().formatException(record.exc_info), values)
        return True


def filter_run_logs() -> None:
    for handler in {*logging.getLogger("prefect").handlers, *logging.getLogger().handlers}:
        if not any(isinstance(f, RunLogFilter) for f in handler.filters):
            handler.addFilter(RunLogFilter())


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: a bad profile or device fails at once, faults may retry."""
    try:
        state.result()
    except UserError:
        return False
    except Exception:
        return True
    return True


@contextmanager
def progress_artifact(key: str, description: str) -> Iterator[None]:
    """The stage's progress bars, also as a Prefect progress artifact (updated at most once a second)."""
    artifact_id = create_progress_artifact(0.0, key=key, description=description)
    last_update = 0.0

    def update(fraction: float, what: str) -> None:
        nonlocal last_update
        now = time.monotonic()
        if fraction < 1.0 and now - last_update < PROGRESS_UPDATE_S:
            return
        last_update = now
        try:
            update_progress_artifact(artifact_id, progress=round(100 * fraction, 1), description=f"{description}: {what}")
        except Exception:  # the UI's progress is not worth failing a download for
            pass

    with reporting_to(update):
        yield
    update_progress_artifact(artifact_id, progress=100.0, description=f"{description}: done")


def stage_task(name: str, **options):
    """A stage's Prefect task, with the settings of its row in STAGE_SETTINGS."""
    return task(name=name, retry_condition_fn=retry_unless_user_error, **STAGE_SETTINGS[name], **options)


@dataclass
class LocalSourceUnchanged(CachePolicy):
    """Part of the data and model stages' cross-run cache key: for a local source directory, what
    it looks like now (file names, sizes, mtimes), so an edited directory is read again."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        spec = inputs["spec"]
        return fingerprint(Path(spec.source)) if spec.source_kind == "local" else None


# Keyed by the stage's inputs and code, not by the run (Prefect's default adds the run id), with
# the result persisted, so a later run with the same data and model settings skips the stage.
CACHED_ACROSS_RUNS = dict(cache_policy=INPUTS + TASK_SOURCE + LocalSourceUnchanged(), persist_result=True)


def reuse_only_if_intact(task_fn, output_dir: Path, in_store: bool):
    """The task, which an earlier run's cached result may stand in for while the directory that
    result names passes the store's own check (`verify_entry`: see `what_is_checked`), and what
    that check was; a damaged entry makes the task run, which repairs it and replaces the result.
    A local model directory is used in place: its fingerprint is part of the cache key."""
    if in_store:
        intact, checked = not verify_entry(output_dir), what_is_checked(output_dir)
    else:
        intact, checked = output_dir.is_dir(), "file names, sizes and mtimes, in the cache key"
    return (task_fn if intact else task_fn.with_options(refresh_cache=True)), checked


def check_shared(path: str, setting: str, ray_address: str | None, env: RuntimeEnv | None) -> None:
    """On a cluster, the stage's output must be visible from every node before training starts."""
    if ray_address:
        connect_ray(ray_address, env.ray_runtime_env() if env else None)
        nodes = check_visible_on_nodes([Path(path)], setting)
        get_run_logger().info("%s is visible from all %d Ray nodes", path, nodes)


@stage_task("detect_device")
def detect_device_task(request: RunRequest) -> DeviceInfo:
    device = detect_device(requested_device(request.device))
    get_run_logger().info("device: %s (%s)", device.kind, device.reason)
    return device


@stage_task("resolve_profile")
def resolve_profile_task(request: RunRequest, device: DeviceInfo, run_dir: Path) -> RunProfile:
    profile = profile_for(request, device.kind)
    check_plan(request, profile, device, dry_run=False)
    check_run_dir(run_dir, dry_run=False)
    write_text_atomic(run_dir / "profile.yaml", yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return profile


@stage_task("prepare_environment")
def prepare_environment_task(profile: RunProfile, run_dir: Path, ray_address: str | None) -> RuntimeEnv:
    env = resolve_environment(profile, ray_address=ray_address)
    env.check_references()
    # The driver is the process that starts Ray and the backends; they inherit it from here.
    env.apply()
    for action in env.proxy_actions:
        get_run_logger().info("proxy policy %s: %s", env.proxy_policy, action)
    redacted = env.redacted()
    write_json_atomic(run_dir / "env.json", redacted)
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


@stage_task("train")
def train_task(
    profile: RunProfile,
    device: DeviceInfo,
    env: RuntimeEnv,
    data: DatasetFiles,
    model: ModelCheckpoint,
    run_dir: Path,
    ray_address: str | None,
) -> TrainResult:
    logger = get_run_logger()
    settings = plan_local_training(profile, data.train_files, model.path, run_dir, device.count)
    if overlong := check_prompt_lengths(settings):
        logger.warning("%d prompts longer than data.max_prompt_length=%d are left out", overlong, settings.max_prompt_length)
    start = latest_step(settings.checkpoints) or 0
    if start:
        logger.info("resuming from checkpoint global_step_%d of %d", start, settings.max_steps)

    def on_step(record: dict) -> None:
        bar.update(record["step"] - bar.n)
        logger.info(
            "step %d/%d reward %.3f +- %.3f | kl %s | loss %.4f | entropy %.3f | length %.1f | %.0f tokens/s | %.2f s",
            record["step"], settings.max_steps, record["reward_mean"], record["reward_std"] or 0.0,
            "-" if record["kl"] is None else f"{record['kl']:.4f}", record["loss"] or 0.0, record["entropy"] or 0.0,
            record["response_length"], record["tokens_per_s"] or 0.0, record["step_time_s"],
        )

    with progress_artifact("train", f"GRPO {profile.model.name} ({settings.workers} workers)"):
        with Bar(total=settings.max_steps, initial=start, desc="GRPO steps", unit="step") as bar:
            result = train_local(settings, env.ray_runtime_env(), ray_address, on_step, run_name=run_dir.name)
    if result.already_complete:
        logger.warning("the run was already complete at step %d: nothing trained", result.steps_done)
    write_json_atomic(run_dir / "train.json", result.model_dump(mode="json"))
    return result


@stage_task("export_checkpoint")
def export_checkpoint_task(train: TrainResult, run_dir: Path) -> ExportedPolicy:
    policy = export_checkpoint(train.backend, train.checkpoint_dir, train.steps_done)
    get_run_logger().info("trained policy (step %d) verified: %s", policy.step, policy.path)
    write_json_atomic(run_dir / "policy.json", policy.model_dump(mode="json"))
    return policy


@stage_task("evaluate")
def evaluate_task(
    profile: RunProfile, device: DeviceInfo, data: DatasetFiles, model: ModelCheckpoint,
    policy: ExportedPolicy | None, run_dir: Path,
) -> EvalReport:
    logger = get_run_logger()
    if profile.eval.models:
        models = {Path(path).name: Path(path).expanduser() for path in profile.eval.models}
    else:
        models = {"base": Path(model.path)} | ({"trained": Path(policy.path)} if policy else {})
    settings = EvalSettings.from_profile(profile.eval, profile.data.max_response_length,
                                         profile.algorithm.reward_function, device.kind)
    with progress_artifact("evaluate", f"evaluate {', '.join(models)}"):
        engine = choose_engine(device.kind, device.count)
        logger.info("generation engine: %s", engine.__name__)
        report = evaluate(models, Path(data.val_files[0]), settings, run_dir / "eval", engine)
    rows = []
    for m in report.models:
        logger.info("%s: mean reward %.3f [%.3f, %.3f], accuracy %.3f, format %.3f, pass@%d %.3f, length %.1f (p95 %d), "
                    "truncated %.3f", m.name, m.mean_reward, *m.reward_ci95, m.accuracy, m.format_rate, m.k, m.pass_at_k,
                    m.response_length_mean, m.response_length_p95, m.truncation_rate)
        rows.append(f"| {m.name} | {m.mean_reward:.3f} [{m.reward_ci95[0]:.3f}, {m.reward_ci95[1]:.3f}] | {m.accuracy:.3f} "
                    f"| {m.format_rate:.3f} | {m.pass_at_k:.3f} | {m.response_length_mean:.1f} | {m.truncation_rate:.3f} |")
    write_json_atomic(run_dir / "eval" / "eval.json", report.model_dump(mode="json"))
    create_markdown_artifact(
        key="evaluation",
        markdown="| model | mean reward [95% CI] | accuracy | format | pass@k | length | truncated |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n",
        description=f"Evaluation on {report.models[0].prompts} validation prompts",
    )
    return report


@dataclass
class RunRecord:
    """What a flow run has done so far; the failure hooks write the report from it."""

    run_dir: Path
    device: DeviceInfo
    profile: RunProfile | None = None
    env: RuntimeEnv | None = None
    result: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    stage: str | None = None
    failure: str | None = None

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Work that a failure report names `name`: a stage's task, or the flow's own work between
        tasks (finding a store entry, checking the cluster), timed under that name."""
        self.stage = name
        started = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.failure = f"Stage `{name}`: {type(exc).__name__}: {scrub(str(exc))}"
            raise
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - started

    def run(self, stage: str, task_fn, *args, checked: str | None = None):
        """Run one stage's task; a cache hit is said to be one, with what was checked to trust it."""
        with self.step(stage):
            state = task_fn(*args, return_state=True)
            value = state.result()
            if state.name == "Cached":
                get_run_logger().info("%s: skipped, its inputs and output are unchanged since an earlier run (checked: %s)",
                                      stage, checked)
                value = value.model_copy(update={"cached": True})
            return value


# Flow runs of this process, by id, for the failure hooks (they get the run, not its variables).
RUNS: dict[UUID, RunRecord] = {}


def after_failure(flow, flow_run, state) -> None:
    """Prefect `on_failure` / `on_crashed` / `on_cancellation` (a cancel from the UI stops the
    run's process): stop the Ray job the run started (its training workers hold devices), and write
    where the run stopped into the report, next to what it did produce."""
    record = RUNS.pop(flow_run.id, None)
    stopped = stop_ray_job()
    logger = get_logger("grpo_pipeline")
    if stopped:
        logger.info("stopped this run's Ray job")
    if record is None:
        return  # the device could not be decided: no run directory; Prefect's state message says why
    failure = record.failure or f"Stage `{record.stage}`: {scrub(state.message or '')}"
    try:
        write_json_atomic(record.run_dir / "timings.json", record.timings)
        path = _report(record, failure=failure)
    except OSError as exc:  # the run's folder itself may be what failed
        logger.error("the run failed in stage %s; no report (%s)", record.stage, exc.strerror or exc)
        return
    logger.error("the run failed in stage %s; report: %s", record.stage, path)


@flow(name="grpo_pipeline", log_prints=True, on_failure=[after_failure], on_crashed=[after_failure],
      on_cancellation=[after_failure])
def grpo_pipeline(request: RunRequest) -> dict:
    """GRPO post-training, from a bare machine to an evaluated checkpoint.

    Args:
        request: What to run: the model recipe, the device, the backend, profile overrides, the
            stages, where the run's files go, and the Ray cluster.
    """
    filter_run_logs()
    flow_run_id = get_run_context().flow_run.id
    database = lease.database_of_this_run()
    with lease.held(database):
        lease.note_flow_run(flow_run_id)
        lease.end_leftovers(database, get_run_logger().warning)
        record = _run_planning_and_stages(request, flow_run_id)
    RUNS.pop(flow_run_id, None)
    return record.result


def _run_planning_and_stages(request: RunRequest, flow_run_id: UUID) -> RunRecord:
    started = time.perf_counter()
    device = detect_device_task(request)
    run_dir = run_dir_for(request, device.kind)
    record = RUNS[flow_run_id] = RunRecord(run_dir=run_dir, device=device)
    record.timings["detect_device"] = time.perf_counter() - started
    record.result.update(run_dir=str(run_dir), device=device.kind)
    if "resolve_profile" in request.stages:
        record.profile = record.run("resolve_profile", resolve_profile_task, request, device, run_dir)
    if "prepare_environment" in request.stages:
        record.env = record.run("prepare_environment", prepare_environment_task, record.profile, run_dir,
                                request.ray_address)
        _run_stages(request, record)
        write_json_atomic(run_dir / "timings.json", record.timings)
    return record


def _run_stages(request: RunRequest, record: RunRecord) -> None:
    profile, env, run_dir, result = record.profile, record.env, record.run_dir, record.result
    data = model = policy = None
    if "fetch_dataset" in request.stages:
        with record.step("fetch_dataset"):
            spec = DataSpec.from_profile(profile.data)
            fetch, checked = reuse_only_if_intact(fetch_dataset_task, dataset_dir(spec), in_store=True)
        data = record.run("fetch_dataset", fetch, spec, checked=checked)
        with record.step("fetch_dataset: check that every Ray node sees data.root"):
            check_shared(data.path, "data.root", request.ray_address, env)
        write_json_atomic(run_dir / "data" / "dataset.json", data.model_dump(mode="json"))
        result["dataset"] = data.model_dump(mode="json")
    if "prepare_checkpoint" in request.stages:
        with record.step("prepare_checkpoint"):
            spec = ModelSpec.from_profile(profile.model)
            prepare, checked = reuse_only_if_intact(prepare_checkpoint_task, model_dir(spec), spec.source_kind != "local")
        model = record.run("prepare_checkpoint", prepare, spec, profile.model.architecture, checked=checked)
        with record.step("prepare_checkpoint: check that every Ray node sees model.root"):
            check_shared(model.path, "model.root", request.ray_address, env)
        write_json_atomic(run_dir / "model.json", model.model_dump(mode="json"))
        result["model"] = model.model_dump(mode="json")
    command = training_command(request, profile, env, run_dir, data, model)
    write_json_atomic(run_dir / "plan.json", {"backend": profile.backend, "command": command})
    result["command"] = command
    if "train" in request.stages:
        train = record.run("train", train_task, profile, record.device, env, data, model, run_dir, request.ray_address)
        result["train"] = train.model_dump(mode="json")
        if "export_checkpoint" in request.stages:
            policy = record.run("export_checkpoint", export_checkpoint_task, train, run_dir)
            result["policy"] = policy.model_dump(mode="json")
    if "evaluate" in request.stages:
        evaluation = record.run("evaluate", evaluate_task, profile, record.device, data, model, policy, run_dir)
        result["eval"] = evaluation.model_dump(mode="json")
    if "report" in request.stages:
        result["report"] = str(record.run("report", report_task, record))


def _report(record: RunRecord, failure: str | None = None) -> Path:
    return write_report(
        record.run_dir, profile=record.profile.model_dump(mode="json") if record.profile else None,
        device=record.device.model_dump(mode="json"), env=record.env.redacted() if record.env else None,
        train=record.result.get("train"), evaluation=record.result.get("eval"), timings=dict(record.timings),
        failure=failure,
    )


@stage_task("report")
def report_task(record: RunRecord) -> Path:
    path = _report(record)
    create_markdown_artifact(key="run-report", markdown=path.read_text(),
                             description=f"Report of run {record.run_dir.name}")
    get_run_logger().info("report: %s", path)
    return path
