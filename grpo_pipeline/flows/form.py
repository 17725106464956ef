"""The pipeline as a deployment's form shows it: one plain field per thing a person fills.

    prefect deploy --all && prefect deployment run grpo_pipeline/local-smoke -p model=tiny

Prefect makes a deployment's form from its flow's signature. `grpo_pipeline(request, plan)` is the
right signature for the command line (it passes the plan it checked, and the flow runs exactly that)
but the wrong form: a wrapper object, an internal `plan` switch of ~170 fields, and `str | None`
toggles. `run_from_form` is the same flow (`grpo_pipeline`, the same body and failure hooks) behind
flat fields: text boxes where empty means the default, enums as dropdowns, the stages as a
multi-select, `model` required. What a JSON schema can decide (the override box's grammar, secrets
given as literals, credentials in a URL, control characters, a run name's characters) is checked by
the Prefect API before it stores a run, and by the run again, from one definition
(run/form_rules.py); what only the run can check fails it in its first seconds with one line as
the state's message, and no traceback in its logs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from prefect import flow, get_run_logger
from prefect.states import Failed
from pydantic import Field

from grpo_pipeline.flows.pipeline import FLOW_OPTIONS, run_pipeline
from grpo_pipeline.run.form_rules import json_schema
from grpo_pipeline.run.request import STAGES, RunRequest
from grpo_pipeline.tasks.policy import filter_run_logs
from grpo_pipeline.profiles.backend_table import BackendChoice
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.profiles.tracking import TrackerName

Stage = Literal[STAGES]  # type: ignore[valid-type]  # the UI offers the names to pick from


def checked(field: str):
    """The form's rules for a text box, as JSON schema only (`json_schema_extra`): the Prefect API checks
    them with Python's `re` (pydantic's regex engine has no look-ahead); the run checks them again."""
    return Field(json_schema_extra=json_schema(field))


@flow(**FLOW_OPTIONS)
def run_from_form(
    model: Annotated[str, Field(min_length=1), checked("model")],
    device: Literal["auto", "gpu", "npu", "cpu"] = "auto",
    backend: BackendChoice = "auto",
    overrides: Annotated[str, checked("overrides")] = "",
    stages: list[Stage] = list(STAGES),
    run_name: Annotated[str, checked("run_name")] = "",
    run_root: Annotated[str, checked("run_root")] = "runs",
    ray_address: Annotated[str, checked("ray_address")] = "",
    profile_file: Annotated[str, checked("profile_file")] = "",
    trackers: list[TrackerName] = [],  # noqa: B006  (Prefect builds the form from this default; never mutated)
):
    """GRPO post-training, from a bare machine to an evaluated checkpoint.

    Args:
        model: Required. A built-in recipe (qwen3.5-122b-a10b, qwen3.5-35b-a3b, smollm2-135m, tiny) or
            the path of a Hugging Face model directory on the worker's host.
        device: Where to train. `auto` probes NPU, then CUDA, then uses the CPU (the worker's DEVICE
            variable, if set, decides instead).
        backend: The training backend (profiles/backend_table.py): `auto` takes the recipe's, or one
            that runs without accelerators on a device that has none.
        overrides: Profile settings, one KEY=VALUE a line, e.g. `trainer.total_training_steps=20` or
            `engine.tp=4`, a trailing `# comment` allowed; values plain, quoted or a [list] (nested
            settings by dotted keys); empty: the recipe as it is. Never a secret's value (this form is
            stored): name it as `env.HF_TOKEN=${HF_TOKEN}` and export it in the worker's environment.
        stages: Stages to run, in flow order; empty: all. The stages a picked one reads from run with
            it (cached, they take about a second), and any work ends with the report.
        run_name: Name of the run's folder (letters, digits, '.', '_', '-'); empty:
            model-device-timestamp. A second run of a folder while one is live is refused.
        run_root: The folder that holds one folder per run, on the host of the worker that runs the
            flow; a relative path is under the worker's working directory (for prefect.yaml's
            deployments: the checkout the worker was started in). The report shows the absolute path.
        ray_address: An existing Ray cluster, `head:6379` or `ray://head:10001` (the verl backend needs
            one); empty: the worker's RAY_ADDRESS (prefect.yaml sets it per cluster), else a local Ray.
        profile_file: A YAML file of profile settings on the worker's host, applied before the
            overrides; empty: none.
        trackers: Experiment trackers that get the run (docs/tracking.md): MLflow (the worker's
            MLFLOW_TRACKING_URI), Weights & Biases (the worker's WANDB_API_KEY; never typed here),
            TensorBoard (event files in the run's folder); empty: none, or the profile's
            `tracking.trackers`. Their other settings are overrides (`tracking.wandb.project=...`).
    """
    filter_run_logs()  # before the form's fields are read: a refusal is its one line, with no traceback after it
    try:
        request = RunRequest.from_form(model=model, device=device, backend=backend, overrides=overrides, stages=stages,
                                       run_name=run_name, run_root=run_root, ray_address=ray_address,
                                       profile_file=profile_file, trackers=trackers)
        return run_pipeline(request, None)
    except UserError as exc:
        # The state's message is what the UI shows for the run: the one line that says what to fix.
        message = f"error: {scrub(str(exc))}"
        get_run_logger().error(message)
        return Failed(message=message)
