"""The `grpo_pipeline` Prefect flow: thin task wrappers around the plain stage functions.

    python -m flows.grpo --model tiny --device cpu --run-name try1

Each stage is one task and hands the next a typed value. Config errors (`UserError`) are never
retried; anything else may be, per stage.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from flows.plan import profile_for, run_dir_for, training_command
from flows.request import RunRequest
from profiles.errors import UserError
from profiles.schema import RunProfile
from tasks.device import DeviceInfo, detect_device, requested_device
from tasks.environment import RuntimeEnv, resolve_environment
from tasks.files import write_json_atomic, write_text_atomic


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: a bad profile or device fails at once, faults may retry."""
    try:
        state.result()
    except UserError:
        return False
    except Exception:
        return True
    return True


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


@flow(name="grpo_pipeline", log_prints=True)
def grpo_pipeline(request: RunRequest) -> dict:
    """GRPO post-training, from a bare machine to an evaluated checkpoint."""
    device = detect_device_task(request)
    run_dir = run_dir_for(request, device.kind)
    result: dict = {"run_dir": str(run_dir), "device": device.kind}
    if "resolve_profile" not in request.stages:
        return result
    profile = resolve_profile_task(request, device, run_dir)
    if "prepare_environment" in request.stages:
        env = prepare_environment_task(profile, run_dir, request.ray_address)
        command = training_command(request, profile, env, run_dir)
        write_json_atomic(run_dir / "plan.json", {"backend": profile.backend, "command": command})
        result["command"] = command
    return result
