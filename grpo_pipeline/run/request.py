"""`RunRequest`: what a person asks for, from the CLI, a flow run form in the Prefect UI, or a deployment."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from grpo_pipeline.errors import ProfileError, UserError
from grpo_pipeline.profiles.backend_table import BackendChoice, backend_help
from grpo_pipeline.profiles.loader import overrides_to_layer
from grpo_pipeline.profiles.secrets import has_url_credentials, secret_holder, secret_literal_problems
from grpo_pipeline.cluster.ray_address import parse_ray_address
from grpo_pipeline.run.form_rules import FORM_RULES, ONE_LINE, RUN_NAME, first_broken, override_lines

# The stages of the flow in order. `--stages` picks a subset.
PLANNING_STAGES = ("detect_device", "resolve_profile", "prepare_environment")
STAGES = (*PLANNING_STAGES, "fetch_dataset", "prepare_checkpoint", "train", "export_checkpoint", "evaluate", "report")
# Stages whose outputs a stage reads; they run with it (cached, or a finished run's training, they
# cost about a second).
INPUT_STAGES = {
    "train": ("fetch_dataset", "prepare_checkpoint"),
    "export_checkpoint": ("train",),
    "evaluate": ("fetch_dataset", "prepare_checkpoint"),
}


# A run's command when its backend trains inside the flow: the same run again from the command line.
RERUN_COMMAND = ["python", "-m", "grpo_pipeline"]

class RunRequest(BaseModel):
    # A request is stored by Prefect and shown in its UI; a validation error must not echo its values.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    model: str = Field(
        "smollm2-135m",
        title="Model",
        description="A built-in recipe (qwen3.5-122b-a10b, qwen3.5-35b-a3b, smollm2-135m, tiny) or the "
        "path of a local Hugging Face model directory.",
    )
    device: Literal["auto", "gpu", "npu", "cpu"] = Field(
        "auto",
        title="Device",
        description="Where to train. `auto` probes NPU, then CUDA, then uses the CPU; the DEVICE env var "
        "is used when this is `auto`.",
    )
    backend: BackendChoice = Field("auto", title="Training backend", description=backend_help())
    overrides: list[str] = Field(
        default_factory=list,
        title="Overrides",
        description="Profile settings as KEY=VALUE, e.g. `engine.tp=4` or `algorithm.use_kl_loss=true`. Never a "
        "secret's value nor credentials in a URL (this form is stored): name it by reference in an env entry, "
        "`env.HF_TOKEN=${HF_TOKEN}` or `env.MY_DB_URL=${MY_DB_URL}`, and export it in the worker's environment.",
    )
    profile_file: str | None = Field(
        None, title="Profile file", description="A YAML file of profile settings, applied before the overrides."
    )
    stages: list[str] = Field(
        list(STAGES),  # a default, not a factory, so the UI's form shows it
        title="Stages",
        description="Stages to run, in flow order; empty: all. The planning stages (detect_device, resolve_profile, "
        "prepare_environment) that a later stage depends on always run with it, and so do the data and model "
        "stages when training is asked for (with their results cached they take about a second); any stage "
        "after planning ends with the report.",
        # The UI's form offers the stage names to pick from.
        json_schema_extra={"items": {"type": "string", "enum": list(STAGES)}},
    )
    run_name: str | None = Field(
        None, title="Run name", description="Name of the run directory; default: model-device-timestamp."
    )
    run_root: str = Field("runs", title="Run root", description="Directory that holds one folder per run.")
    ray_address: str | None = Field(
        None,
        title="Ray address",
        description="An existing Ray cluster (as RAY_ADDRESS; the verl backend needs one); empty starts a local Ray.",
    )

    @classmethod
    def from_form(cls, *, overrides: str, profile_file: str, run_name: str, ray_address: str,
                  trackers: list[str] | None = None, **fields) -> RunRequest:
        """The request a deployment's form makes: text boxes, where empty means the default and the
        overrides are one KEY=VALUE a line. The form's rules (run/form_rules.py) first, as the
        Prefect API checked them, so a run from the form accepts exactly what the form accepts. The
        trackers picked are the profile's `tracking.trackers`, ahead of the typed overrides (a typed
        line still wins)."""
        texts = {"model": fields.get("model", ""), "overrides": overrides, "run_name": run_name,
                 "run_root": fields.get("run_root", ""), "ray_address": ray_address, "profile_file": profile_file}
        for field, text in texts.items():
            if field in FORM_RULES and isinstance(text, str) and (problem := first_broken(field, text)):
                raise UserError(problem)
        lines = override_lines(overrides)
        if trackers:
            lines = [f"tracking.trackers=[{','.join(dict.fromkeys(trackers))}]", *lines]
        try:
            return cls(overrides=lines, profile_file=profile_file.strip() or None,
                       run_name=run_name.strip() or None, ray_address=ray_address.strip() or None, **fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise UserError(f"{'.'.join(map(str, error['loc']))}: {error['msg'].removeprefix('Value error, ')}") from None

    @field_validator("stages")
    @classmethod
    def known_stages(cls, stages: list[str]) -> list[str]:
        if not stages:
            return list(STAGES)
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
        while missing := {needed for s in stages for needed in INPUT_STAGES.get(s, ())} - set(stages):
            stages = [*stages, *missing]
        if set(stages) - set(PLANNING_STAGES):
            # Work beyond planning always ends with the report of what it did.
            stages = [*stages, *PLANNING_STAGES, "report"]
        elif stages:
            # Each planning stage needs the ones before it.
            stages = [*stages, *PLANNING_STAGES[: max(PLANNING_STAGES.index(s) for s in stages)]]
        return [s for s in STAGES if s in stages]

    @field_validator("overrides")
    @classmethod
    def no_secret_values(cls, overrides: list[str]) -> list[str]:
        """Prefect stores a run's parameters and shows them in its UI: a secret is named here only
        by reference (`env.HF_TOKEN=${HF_TOKEN}`, read where the flow runs; profiles/secrets.py)."""
        try:
            layer = overrides_to_layer(overrides)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        if problems := secret_literal_problems(layer, "--set"):
            raise ValueError("; ".join(problems))
        if any(has_url_credentials(line) for line in overrides):  # where YAML does not look: a comment
            raise ValueError("--set: a line holds credentials in a URL outside its value (a # comment); the line is "
                             "stored as written: remove them")
        return overrides

    @field_validator("model", "profile_file", "run_name", "run_root", "ray_address", mode="before")
    @classmethod
    def no_secret_value(cls, value, info: ValidationInfo):
        """Stored and shown as written (plan.json, the report, tracker runs, Prefect), like an override:
        a value that holds one of this process's secrets is refused before anything else looks at it (URL
        credentials have their own refusal, below)."""
        if isinstance(value, str) and not has_url_credentials(value) and (holder := secret_holder(value)):
            raise ValueError(f"{_option(info.field_name)} holds the value of {holder}, and it is stored and shown as "
                             "written (the run's files, trackers, Prefect); choose another")
        return value

    @field_validator("model", "profile_file", "run_root", "ray_address")
    @classmethod
    def one_line(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A path or an address is printable text on one line: a NUL would fail the first file call."""
        if value and ONE_LINE.broken(value):
            raise ValueError(f"{_option(info.field_name)} must be {ONE_LINE.says}")
        return value

    @field_validator("model", "profile_file", "run_root")
    @classmethod
    def no_url_credentials(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Stored and shown as written, like the overrides; unlike an env value, never a reference."""
        if value and has_url_credentials(value):
            option = _option(info.field_name)
            raise ValueError(f"{option} holds credentials in a URL; it is stored and shown as written: give a repo id or "
                             "a path, and put a hub token in HF_TOKEN (export it; downloads send it)")
        return value

    @field_validator("ray_address")
    @classmethod
    def ray_address_form(cls, address: str | None) -> str | None:
        if address:
            try:
                parse_ray_address(address)
            except UserError as exc:
                raise ValueError(str(exc)) from None
        return address or None

    @field_validator("run_name")
    @classmethod
    def safe_run_name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(RUN_NAME, name):
            raise ValueError(f"--run-name {name!r} must be letters, digits, '.', '_' or '-' (it names a directory)")
        return name


def _option(field: str) -> str:
    """The command line's name of a request's field."""
    return {"run_root": "--run-dir"}.get(field, f"--{field.replace('_', '-')}")
