"""The planning stages as plain functions: device, profile, environment, and the training command.

    python -m grpo_pipeline --model tiny --device cpu --dry-run --json   # plan_run's plan, as plan.json holds it

`plan_run(request)` makes a run's one plan: `--dry-run` prints it, the command line checks it before
Prefect starts, and it is the flow's first task (tasks/stage_tasks.py `plan_run_task`) for every
door, so a run from the form, a deployment or a schedule runs and stores the plan the dry run
prints. No Prefect here: rendering a cluster's command on a laptop needs no server and no accelerator.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainingRun
from grpo_pipeline.store.file_faults import run_folder_problem
from grpo_pipeline.run import lock as run_lock
from grpo_pipeline.run.request import RERUN_COMMAND, RunRequest
from grpo_pipeline.errors import DoesNotFit, ProfileError, UserError
from grpo_pipeline.generation.plan import GenerationPlan, plan_generation
from grpo_pipeline.profiles.loader import given_settings, resolve_run_profile
from grpo_pipeline.profiles.validation import profile_problems, refuse
from grpo_pipeline.planner.lora import describe_adapter, lora_problems
from grpo_pipeline.planner.memory import MemoryPlan
from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.rewards.check import check_rewards
from grpo_pipeline.rewards.plan import RewardPlan
from grpo_pipeline.stages.dataset import DatasetFiles, DataSpec, benchmark_specs, dataset_dir, dataset_problems
from grpo_pipeline.stages.device import DeviceInfo, detect_device, requested_device
from grpo_pipeline.stages.environment import RuntimeEnv, resolve_environment
from grpo_pipeline.stages.model import ModelCheckpoint, ModelSpec, model_dir
from grpo_pipeline.stages.train import training_inputs
from grpo_pipeline.store.hub_reach import hub_endpoint, hub_offline, reach_problem, unreachable
from grpo_pipeline.cluster.ray_address import check_reachable, cluster_address, parse_ray_address
from grpo_pipeline.store.content import read_manifest
from grpo_pipeline.tracking.trackers import missing_credentials, store_problem
from grpo_pipeline.run.folder import RunFolder
from grpo_pipeline.run.identity import check_identity

log = logging.getLogger(__name__)


def _memory_note(device: DeviceInfo, profile: RunProfile, generation: GenerationPlan) -> dict | None:
    """Where the backend has no memory table: its word on memory (the local backend's recomputation and micro
    batch, chosen by the planner), for the dry run's JSON and text alike."""
    note = device.memory_note(profile, generation)
    return {"note": note} if note else None


class RunPlan(BaseModel):
    run_dir: str = Field(..., description="Directory of this run's outputs.")
    device: DeviceInfo
    profile: RunProfile
    backend_reason: str = Field(..., description="Why the profile has its backend.")
    env: RuntimeEnv
    generation: GenerationPlan = Field(..., description="How rollouts and evaluation generate (generation/plan.py).")
    command: list[str] = Field(..., description="The training command (argv) the run will execute.")
    submission: dict | None = Field(None, description="What training submits to the cluster (a verl Ray job).")
    memory: dict | None = Field(None, description="Device memory per role of the layout (planner/memory.py, planner/fsdp.py), "
                                "or `{note}`: the backend's sizing choices and why where it has no table (the local backend).")
    node_requirements: dict[str, dict[str, NodeRequirement]] = Field(
        default_factory=dict, description="What every node of the cluster must have, per stage, checked before the "
        "stage starts there.")

    def summary(self) -> dict[str, Any]:
        """The dry-run JSON: what the run would do, with secrets redacted."""
        summary = {
            "device": self.device.model_dump(),
            "profile": self.profile.model_dump(mode="json"),
            "backend": {"name": self.profile.backend, "reason": self.backend_reason},
            "generation": self.generation.model_dump() | {"path": self.generation.describe()},
            "command": self.command,
            "env": self.env.redacted(),
        }
        summary |= {"lora": adapter} if (adapter := describe_adapter(self.profile)) else {}
        summary |= {"memory": self.memory} if self.memory else {}
        summary |= {"node_requirements": {
            stage: {name: need.model_dump(exclude={"stages"}, exclude_defaults=True) for name, need in needs.items()}
            for stage, needs in self.node_requirements.items()}} if self.node_requirements else {}
        return summary | ({"job": self.submission} if self.submission else {})


def run_dir_for(request: RunRequest, device_kind: str) -> Path:
    name = request.run_name or f"{Path(request.model).name}-{device_kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(request.run_root).expanduser().resolve() / name


def training_command(
    request: RunRequest,
    profile: RunProfile,
    run_dir: Path,
    data: DatasetFiles | None = None,
    model: ModelCheckpoint | None = None,
) -> list[str]:
    """The command the backend runs for training (verl: `main_ppo` on the cluster); for a backend
    that trains inside the flow, the pipeline invocation that reproduces this run."""
    inputs = training_inputs(profile, run_dir, data, model)
    if engine_command := backend_for(profile.backend).command(profile, inputs):
        return engine_command
    command = [*RERUN_COMMAND, "--model", request.model, "--device", profile.platform.kind,
               "--backend", profile.backend, "--run-name", run_dir.name]
    if request.run_root != RunRequest.model_fields["run_root"].default:
        command += ["--run-dir", request.run_root]
    if request.profile_file:
        command += ["--profile-file", request.profile_file]
    for item in request.overrides:
        command += ["--set", item]
    return command


def checked_profile(model: str, device: str, backend: str = "auto", profile_file: str | Path | None = None,
                    overrides: list[str] | dict[str, Any] | None = None,
                    detected: dict[str, Any] | None = None) -> tuple[RunProfile, str]:
    """The profile from its layers (profiles/loader.py), and why it has its backend, checked against every
    rule at once: its backend's own (layout, batches over its ranks, what it cannot run: the planner's
    rules, picked by the backend), those that hold for any backend and the LoRA adapter's target modules
    against the model's own (planner/lora.py); all problems on one line."""
    profile, reason = resolve_run_profile(model, device, backend, profile_file, overrides, validate=False,
                                          detected=detected)
    refuse([*dataset_problems(profile.data), *backend_for(profile.backend).profile_problems(profile),
            *profile_problems(profile), *lora_problems(profile)])
    return profile, reason


def resolve_profile(model: str, device: str, backend: str = "auto", profile_file: str | Path | None = None,
                    overrides: list[str] | dict[str, Any] | None = None) -> RunProfile:
    """`checked_profile`'s profile."""
    return checked_profile(model, device, backend, profile_file, overrides)[0]


def one_device_sizes(profile: RunProfile, generation: GenerationPlan) -> tuple[dict, list[str]] | None:
    """`--suggest-layout` where the profile's backend sizes one device's step (`Backend.size_table`), with the
    generation plan the run would have; None: its layouts are searched instead."""
    return backend_for(profile.backend).size_table(profile, generation)


def layered_profile(request: RunRequest, device_kind: str) -> tuple[RunProfile, GenerationPlan]:
    """The profile from its layers, not checked yet (the device profile's default layout may not fit this
    host's rules), and how the run will generate: the one place `plan_generation` is called. Neither the
    checks nor the layer of the devices found on a host set `platform`, and of `generation` that layer sets at
    most the rounds (`profile_for`'s plan follows them), so the plan made here is the checked profile's."""
    unchecked, _ = resolve_run_profile(request.model, device_kind, request.backend, request.profile_file,
                                       request.overrides, validate=False)
    return unchecked, plan_generation(unchecked)


def profile_for(request: RunRequest, device: DeviceInfo) -> tuple[RunProfile, str, GenerationPlan]:
    """The run's profile, why it has its backend (`--backend auto`: the recipe and the device decide), and
    how it generates. On one host whose devices were counted, the backend may plan for them (the local
    backend: one worker per GPU found, unless a recipe, a profile file or --set names cluster.devices_per_node;
    the micro batch and gradient checkpointing the step needs on those GPUs: backends/local/sizing.py)."""
    args = (request.model, device.kind, request.backend, request.profile_file, request.overrides)
    unchecked, generation = layered_profile(request, device.kind)
    layer = None
    if device.count > 0 and not cluster_address(request.ray_address)[0]:
        given = given_settings(request.model, device.kind, request.profile_file, request.overrides)
        layer = backend_for(unchecked.backend).detected_layer(unchecked, device.count, generation,
                                                              *device.found(unchecked), given=given)
    profile, reason = checked_profile(*args, detected=layer or None)
    return profile, reason, generation.with_rounds_of(profile)  # the rounds the layer may have set


def check_plan(request: RunRequest, profile: RunProfile, device: DeviceInfo, dry_run: bool) -> MemoryPlan | None:
    """Refuse, before anything is fetched or started, what a later stage would fail on: what the
    backend cannot run here (a stage it cannot run from the flow, more training workers than the
    host has devices), a data or model source that is not there, and (for a real run) a Ray
    cluster that does not answer; a layout that cannot fit in memory (the plan it was checked against
    is returned; under planner.enforce=false it is logged as a warning instead); an MLflow store that
    cannot be made."""
    stages = request.stages
    backend_for(profile.backend).check_run(profile, device.count, stages, dry_run, request.ray_address)
    memory = device.memory_plan(profile)
    if memory is not None and not memory.fits:
        if memory.enforced:
            raise ProfileError(memory.refusal())
        log.warning("%s", memory.warning())  # planner.enforce=false: the dry run and the report show it too
    if {"fetch_dataset", "train", "evaluate"} & set(stages):
        spec = DataSpec.from_profile(profile.data)
        if {"train", "evaluate"} & set(stages):
            check_planned_reward(profile, spec)
    if {"prepare_checkpoint", "train", "evaluate"} & set(stages):
        ModelSpec.from_profile(profile.model)
    if problem := store_problem(profile.tracking, write=not dry_run):
        raise ProfileError(problem)
    address, origin = cluster_address(request.ray_address)
    if not dry_run and address:
        if parsed := parse_ray_address(address, origin):
            check_reachable(parsed, origin)
    return memory


def check_planned_reward(profile: RunProfile, data: DataSpec) -> None:
    """The rewards a user brings import, with an accepted signature, in a child process (rewards/check.py); with
    the dataset already in the store, the columns they ask for are there and a call on two rows gives numbers
    (otherwise the train and evaluate stages check that before anything starts)."""
    train_file = dataset_dir(data) / "train.parquet"
    plan = RewardPlan.from_section(profile.reward)
    for line in check_rewards(plan, str(train_file) if train_file.is_file() else None, profile.reward.check_timeout_s):
        log.info("%s", line)


def check_hub_sources(stages: list[str], profile: RunProfile, environ: dict[str, str]) -> None:
    """What the run must fetch from the hub (not in the store yet) can be fetched with the run's environment:
    refused now, in one line, where the hub cannot be reached or HF_HUB_OFFLINE is set, instead of after the
    flow started and the stage's retries were spent."""
    missing = []
    if {"fetch_dataset", "train", "evaluate"} & set(stages):
        data = DataSpec.from_profile(profile.data)
        if data.source_kind == "hub" and read_manifest(dataset_dir(data)) is None:
            missing.append((f"dataset {data.source}", dataset_dir(data), "a local copy (--set data.source=<its folder>)"))
    if {"prepare_checkpoint", "train", "evaluate"} & set(stages):
        model = ModelSpec.from_profile(profile.model)
        if model.source_kind == "hub" and read_manifest(model_dir(model)) is None:
            missing.append((f"model {model.source}", model_dir(model), "a local copy (--set model.path=<its folder>)"))
    if "evaluate" in stages:
        missing += [(f"benchmark {name} ({spec.source})", dataset_dir(spec), "eval.benchmarks without it")
                    for name, spec in benchmark_specs(profile).items()
                    if spec.source_kind == "hub" and read_manifest(dataset_dir(spec)) is None]
    if not missing:
        return
    what, entry, local_copy = missing[0]
    if hub_offline(environ):
        raise UserError(f"cannot fetch {what}: HF_HUB_OFFLINE is set and the store has no copy of it; unset it, or use "
                        f"{local_copy}\nthe store's place for it: {entry}")
    endpoint = hub_endpoint(environ)
    if problem := reach_problem(endpoint, environ):
        raise unreachable(what, problem, endpoint, local_copy, str(entry))


def check_tracker_credentials(profile: RunProfile, environ: dict[str, str]) -> None:
    """A tracker that needs credentials the run's environment lacks fails the start now (with
    `tracking.on_unreachable=warn` the run goes on without it, and says so when it opens the trackers)."""
    if profile.tracking.on_unreachable == "fail" and (missing := missing_credentials(profile.tracking, environ)):
        raise UserError(missing)


def check_run_dir(run_dir: Path, dry_run: bool) -> None:
    """The run's folder can exist here: each name within the file system's limit and, for a run, the
    folder made, written to, and held for this run alone (run/lock.py); a dry run writes nothing:
    it only checks the names."""
    ancestor = next(p for p in (run_dir, *run_dir.parents) if _exists(p))
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    too_long = [part for part in run_dir.relative_to(ancestor).parts if len(os.fsencode(part)) > name_max]
    if too_long:
        raise UserError(f"--run-dir/--run-name: the name {too_long[0][:40]}... is {len(os.fsencode(too_long[0]))} bytes, "
                        f"more than the file system's limit of {name_max}; choose a shorter --run-name")
    if _exists(run_dir) and (problem := run_folder_problem(run_dir, RunFolder.KEPT)):
        raise UserError(f"--run-dir/--run-name: {problem}")
    if dry_run:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise UserError(f"--run-dir: cannot write the run's folder {run_dir} ({exc.strerror or exc}); choose a writable "
                        "--run-dir") from None
    run_lock.claim(run_dir)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long, a part that is a file: treated as not there
        return False


def plan_run(request: RunRequest, dry_run: bool = False) -> RunPlan:
    """The run's plan, checked: the first task of every flow run (flows/pipeline.py), whichever door it came
    in by (the command line plans before Prefect starts and hands the flow this plan; the form, a deployment
    and a schedule plan in that task), and what `--dry-run` prints. A refusal is one line (UserError),
    before anything is fetched or started. A real run's plan holds its run folder (run/lock.py)."""
    device = detect_device(requested_device(request.device), dry_run=dry_run, cluster=cluster_address(request.ray_address)[0])
    try:
        profile, backend_reason, generation = profile_for(request, device)
    except DoesNotFit:  # sized for the devices found: nothing else to name
        raise
    except ProfileError:
        # A profile refused for its batch split may be one asking for more workers than this host has:
        # that is the problem to name (the batch rules follow from it).
        unchecked, _ = resolve_run_profile(request.model, device.kind, request.backend, request.profile_file,
                                           request.overrides, validate=False)
        backend_for(unchecked.backend).check_run(unchecked, device.count, request.stages, dry_run, request.ray_address)
        raise
    memory = check_plan(request, profile, device, dry_run)
    env = resolve_environment(profile, ray_address=request.ray_address)
    if not dry_run:
        env.check_references()
        environ = dict(os.environ)
        env.apply(environ)  # the environment the run's stages will have
        check_hub_sources(request.stages, profile, environ)
        check_tracker_credentials(profile, environ)
    run_dir = run_dir_for(request, device.kind)
    check_identity(run_dir, profile.model_dump(mode="json"))  # a folder holding another request's policy: refused
    check_run_dir(run_dir, dry_run)
    try:
        run = TrainingRun(inputs=training_inputs(profile, run_dir), run_dir=str(run_dir), run_name=run_dir.name,
                          devices_here=device.count, ray_address=request.ray_address,
                          runtime_env=env.ray_runtime_env(), generation=generation)
        backend = backend_for(profile.backend)
        return RunPlan(
            run_dir=str(run_dir), device=device, profile=profile, backend_reason=backend_reason, env=env,
            generation=generation,
            command=training_command(request, profile, run_dir), submission=backend.submission(profile, run),
            memory=memory.summary() if memory else _memory_note(device, profile, generation),
            # What the backend checks on the cluster's nodes, per stage it runs there.
            node_requirements={stage: needs for stage in ("train", "evaluate")
                               if (needs := backend.node_requirements(profile, stage))},
        )
    except BaseException:
        if not dry_run:  # no plan, no run: the folder is free again (a worker's process runs many flows)
            run_lock.release(run_dir)
        raise
