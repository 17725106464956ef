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
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.tasks import exponential_backoff

from backends.local import TrainResult, check_prompt_lengths, latest_step, plan_local_training, train_local
from flows.plan import profile_for, run_dir_for, training_command
from flows.request import RunRequest
from profiles.errors import UserError
from profiles.schema import RunProfile
from tasks.dataset import DatasetFiles, DataSpec, fetch_dataset
from tasks.device import DeviceInfo, detect_device, requested_device
from tasks.environment import RuntimeEnv, resolve_environment
from tasks.evaluate import EvalReport, EvalSettings, choose_engine, evaluate
from tasks.export import ExportedPolicy, export_checkpoint
from tasks.files import write_json_atomic, write_text_atomic
from tasks.model import ModelCheckpoint, ModelSpec, prepare_model
from tasks.nodes import check_visible_on_nodes, connect_ray
from tasks.progress import Bar, reporting_to
from tasks.report import write_report

# Downloads: 4 retries after 2, 4, 8, 16 s (each +-50% jitter), so a mirror's bad minute passes.
FETCH_RETRIES = dict(
    retries=4,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
)
PROGRESS_UPDATE_S = 1.0
# Training: a lost worker, node or collective is retried twice, resuming from the latest checkpoint.
TRAIN_RETRIES = dict(retries=2, retry_delay_seconds=10)


class UserErrorWithoutTraceback(logging.Filter):
    """A user error is reported by its one-line message; Prefect would log its traceback, which only
    buries the line that says what to fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_user_errors() -> None:
    for handler in {*logging.getLogger("prefect").handlers, *logging.getLogger().handlers}:
        if not any(isinstance(f, UserErrorWithoutTraceback) for f in handler.filters):
            handler.addFilter(UserErrorWithoutTraceback())


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


def check_shared(path: str, setting: str, ray_address: str | None, env: RuntimeEnv | None) -> None:
    """On a cluster, the stage's output must be visible from every node before training starts."""
    if ray_address:
        connect_ray(ray_address, env.ray_runtime_env() if env else None)
        nodes = check_visible_on_nodes([Path(path)], setting)
        get_run_logger().info("%s is visible from all %d Ray nodes", path, nodes)


@task(name="detect_device", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def detect_device_task(request: RunRequest) -> DeviceInfo:
    device = detect_device(requested_device(request.device))
    get_run_logger().info("device: %s (%s)", device.kind, device.reason)
    return device


@task(name="resolve_profile", retry_condition_fn=retry_unless_user_error)
def resolve_profile_task(request: RunRequest, device: DeviceInfo, run_dir: Path) -> RunProfile:
    profile = profile_for(request, device.kind)
    write_text_atomic(run_dir / "profile.yaml", yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return profile


@task(name="prepare_environment", retry_condition_fn=retry_unless_user_error)
def prepare_environment_task(profile: RunProfile, run_dir: Path, ray_address: str | None) -> RuntimeEnv:
    env = resolve_environment(profile, ray_address=ray_address)
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


@task(name="fetch_dataset", retry_condition_fn=retry_unless_user_error, **FETCH_RETRIES)
def fetch_dataset_task(
    profile: RunProfile, run_dir: Path, ray_address: str | None, env: RuntimeEnv | None
) -> DatasetFiles:
    logger = get_run_logger()
    spec = DataSpec.from_profile(profile.data)
    with progress_artifact("fetch-dataset", f"dataset {spec.dataset} from {spec.source}"):
        files = fetch_dataset(spec, log=logger.warning)
    logger.info(
        "dataset %s: %s, rows %s, at %s",
        spec.dataset, "cached, nothing fetched" if files.cached else "fetched and verified", files.rows, files.path,
    )
    check_shared(files.path, "data.root", ray_address, env)
    write_json_atomic(run_dir / "data" / "dataset.json", files.model_dump(mode="json"))
    return files


@task(name="prepare_checkpoint", retry_condition_fn=retry_unless_user_error, **FETCH_RETRIES)
def prepare_checkpoint_task(
    profile: RunProfile, run_dir: Path, ray_address: str | None, env: RuntimeEnv | None
) -> ModelCheckpoint:
    logger = get_run_logger()
    spec = ModelSpec.from_profile(profile.model)
    with progress_artifact("prepare-checkpoint", f"base model {spec.source}"):
        checkpoint = prepare_model(spec, profile.model.architecture, log=logger.warning)
    logger.info(
        "base model %s: %s, %s parameters, at %s", spec.source,
        "cached, nothing fetched" if checkpoint.cached else "prepared and verified",
        f"{checkpoint.num_parameters:,}", checkpoint.path,
    )
    check_shared(checkpoint.path, "model.root", ray_address, env)
    write_json_atomic(run_dir / "model.json", checkpoint.model_dump(mode="json"))
    return checkpoint


@task(name="train", retry_condition_fn=retry_unless_user_error, **TRAIN_RETRIES)
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
    if profile.backend != "local":
        raise UserError(
            "the train stage runs the local backend; verl trains on the cluster from the rendered command "
            "(python -m flows.grpo ... --dry-run prints it)"
        )
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


@task(name="export_checkpoint", retry_condition_fn=retry_unless_user_error)
def export_checkpoint_task(train: TrainResult, run_dir: Path) -> ExportedPolicy:
    policy = export_checkpoint(train.backend, train.checkpoint_dir, train.steps_done)
    get_run_logger().info("trained policy (step %d) verified: %s", policy.step, policy.path)
    write_json_atomic(run_dir / "policy.json", policy.model_dump(mode="json"))
    return policy


@task(name="evaluate", retry_condition_fn=retry_unless_user_error)
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


@flow(name="grpo_pipeline", log_prints=True)
def grpo_pipeline(request: RunRequest) -> dict:
    """GRPO post-training, from a bare machine to an evaluated checkpoint."""
    quiet_user_errors()
    timings: dict[str, float] = {}

    def timed(stage: str, task_fn, *args):
        started = time.perf_counter()
        try:
            return task_fn(*args)
        finally:
            timings[stage] = time.perf_counter() - started

    device = timed("detect_device", detect_device_task, request)
    run_dir = run_dir_for(request, device.kind)
    result: dict = {"run_dir": str(run_dir), "device": device.kind}
    if "resolve_profile" not in request.stages:
        return result
    profile = timed("resolve_profile", resolve_profile_task, request, device, run_dir)
    if "prepare_environment" not in request.stages:
        return result
    env = timed("prepare_environment", prepare_environment_task, profile, run_dir, request.ray_address)
    try:
        _run_stages(request, device, profile, env, run_dir, result, timed)
    except BaseException as exc:
        # The report says which stage failed and why, next to whatever the run did produce.
        failed = next(reversed(timings), "?")
        _report(run_dir, profile, device, env, result, timings, failure=f"Stage `{failed}`: {type(exc).__name__}: {exc}")
        raise
    if "report" in request.stages:
        result["report"] = str(timed("report", report_task, run_dir, profile, device, env, result, dict(timings)))
    return result


def _run_stages(request, device, profile, env, run_dir, result, timed) -> None:
    data = model = policy = None
    if "fetch_dataset" in request.stages:
        data = timed("fetch_dataset", fetch_dataset_task, profile, run_dir, request.ray_address, env)
        result["dataset"] = data.model_dump(mode="json")
    if "prepare_checkpoint" in request.stages:
        model = timed("prepare_checkpoint", prepare_checkpoint_task, profile, run_dir, request.ray_address, env)
        result["model"] = model.model_dump(mode="json")
    command = training_command(request, profile, env, run_dir, data, model)
    write_json_atomic(run_dir / "plan.json", {"backend": profile.backend, "command": command})
    result["command"] = command
    if "train" in request.stages:
        train = timed("train", train_task, profile, device, env, data, model, run_dir, request.ray_address)
        result["train"] = train.model_dump(mode="json")
        if "export_checkpoint" in request.stages:
            policy = timed("export_checkpoint", export_checkpoint_task, train, run_dir)
            result["policy"] = policy.model_dump(mode="json")
    if "evaluate" in request.stages:
        result["eval"] = timed("evaluate", evaluate_task, profile, device, data, model, policy, run_dir).model_dump(mode="json")


def _report(run_dir, profile, device, env, result, timings, failure=None) -> Path:
    return write_report(
        run_dir, profile=profile.model_dump(mode="json"), device=device.model_dump(mode="json"), env=env.redacted(),
        train=result.get("train"), evaluation=result.get("eval"), timings=timings, failure=failure,
    )


@task(name="report")
def report_task(run_dir: Path, profile: RunProfile, device: DeviceInfo, env: RuntimeEnv, result: dict,
                timings: dict[str, float]) -> Path:
    path = _report(run_dir, profile, device, env, result, timings)
    create_markdown_artifact(key="run-report", markdown=path.read_text(), description=f"Report of run {run_dir.name}")
    get_run_logger().info("report: %s", path)
    return path
