"""A verl run as a Ray job: what is submitted, and the job's record in the run's folder.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --ray-address head:6379 --dry-run   # "job": ...

Each attempt of the train stage is one Ray job, submitted through Ray's job API (the dashboard's
address, which Ray reads from the cluster given as --ray-address). Its submission id is derived from
the run's name, a token fixed when the run's first job is recorded, and the attempt, so a submit that
is repeated (the flow restarted, a retried call) finds the job already there and follows it instead
of starting a second one; the token keeps a reused run name on the same cluster (a deleted run
folder) from picking up an older run's jobs.

`runs/<run>/verl/job.json` is written before a job is submitted: the failure hooks read it to stop the
job (backends/verl/backend.py `stop`), and the next attempt reads it to decide what to submit.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shlex
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from grpo_pipeline.backends.base import TrainingInputs
from grpo_pipeline.backends.verl.command import verl_command
from grpo_pipeline.backends.verl.rewards import reward_modules
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.tracking.trackers import job_env
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.run.folder import RunFolder

# verl's file logger writes here (its own env var); one file per attempt: verl opens it with "wb".
FILE_LOGGER_PATH_VAR = "VERL_FILE_LOGGER_PATH"
# The job's own status values (ray.job_submission.JobStatus).
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Not Ray's: the cluster stopped answering while the job ran (its head died with it, or is unreachable).
LOST = "LOST"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class JobSpec(BaseModel):
    """Exactly what one attempt submits to Ray's job API."""

    submission_id: str
    entrypoint: str = Field(..., description="The verl command, as one shell line.")
    runtime_env: dict = Field(..., description="Environment of the entrypoint and every worker of the job, on every node.")
    metadata: dict[str, str]
    metrics_file: str = Field(..., description="This attempt's verl file-logger JSONL (shared storage).")


class JobRecord(BaseModel):
    """`runs/<run>/verl/job.json`: the run's current job."""

    token: str = Field(..., description="Fixed for the run folder; part of every submission id.")
    attempt: int
    submission_id: str
    address: str = Field(..., description="The job API (dashboard) address the job was submitted to.")
    metrics_file: str
    status: str | None = Field(None, description=f"The job's status when last seen ({LOST}: its cluster stopped answering).")
    final_step: int | None = Field(None, description="The run's last step, once a job ended it (SUCCEEDED).")
    resumed_from: int | None = Field(None, description="The checkpoint step this attempt resumed from (None: from scratch).")
    model_path: str | None = Field(None, description="The base model's HF directory the job trained from (its config "
                                   "names a dist checkpoint's tensors where verl saved no HF config).")

    @property
    def finished(self) -> bool:
        return self.status == "SUCCEEDED" and self.final_step is not None

    @property
    def ended(self) -> bool:
        """Nothing of the job is left to stop (or to reach)."""
        return self.status in TERMINAL or self.status == LOST

    def attempt_metrics_files(self) -> list[Path]:
        """verl's metrics file of every attempt of the run, the first to this one."""
        stem = self.submission_id.removesuffix(f"-{self.attempt}")
        return [Path(self.metrics_file).with_name(f"metrics-{stem}-{n}.jsonl") for n in range(1, self.attempt + 1)]


def record_path(run_dir: Path) -> Path:
    return Path(run_dir) / RunFolder.JOB / RunFolder.JOB_RECORD


def read_record(run_dir: Path) -> JobRecord | None:
    try:
        return JobRecord.model_validate_json(record_path(run_dir).read_text())
    except (OSError, ValidationError):
        return None


def write_record(run_dir: Path, record: JobRecord) -> None:
    write_json_atomic(record_path(run_dir), record.model_dump(mode="json"))


def new_token() -> str:
    return secrets.token_hex(3)


def submission_id(run_name: str, token: str, attempt: int) -> str:
    return f"grpo-{_UNSAFE.sub('-', run_name).strip('-')[:80]}-{token}-{attempt}"


def profile_hash(profile: RunProfile) -> str:
    return hashlib.sha256(profile.model_dump_json().encode()).hexdigest()[:16]


def job_spec(
    profile: RunProfile, inputs: TrainingInputs, run_dir: Path, run_name: str, runtime_env: dict, token: str,
    attempt: int,
) -> JobSpec:
    """The submission of one attempt. A retry always resumes (`trainer.resume_mode=auto`) from the same
    checkpoint directory, whatever the first attempt was told."""
    if attempt > 1:
        profile = profile.model_copy(
            update={"trainer": profile.trainer.model_copy(update={"resume_mode": "auto"})}
        )
    sid = submission_id(run_name, token, attempt)
    metrics_file = str((Path(run_dir) / RunFolder.JOB / f"metrics-{sid}.jsonl").resolve())
    # verl's loggers continue the run's tracker runs (tracking/trackers.py) from the variables they read.
    env_vars = {**runtime_env.get("env_vars", {}), **job_env(profile.tracking, run_dir),
                FILE_LOGGER_PATH_VAR: metrics_file}
    # The reward's code and files travel with the job (backends/verl/rewards.py): no node needs them on its disk.
    carried = reward_modules(profile, Path(run_dir) / RunFolder.JOB, write=False)
    return JobSpec(
        submission_id=sid,
        entrypoint=shlex.join(verl_command(profile, inputs)),
        runtime_env={**runtime_env, "env_vars": env_vars, **({"py_modules": carried} if carried else {})},
        metadata={"run_name": run_name, "run_dir": str(Path(run_dir).resolve()), "attempt": str(attempt),
                  "profile_hash": profile_hash(profile), "submitted_by": "grpo-pipeline"},
        metrics_file=metrics_file,
    )
