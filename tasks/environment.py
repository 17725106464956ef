"""The `prepare_environment` stage: the environment every process of the run gets, on every node.

    python -m flows.grpo --model qwen3.5-122b-a10b --device npu --dry-run --json   # the "env" object

The profile's env (device platform + model recipe + user layers) is the default; a variable the
user already exported wins, as the upstream launcher's `${VAR:-default}` did, and the result records
which source each value came from. The final values are applied to the driver and packed into the
Ray `runtime_env` that every backend uses, because an `export` in one shell never reaches Ray
workers on other nodes.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, Field

from profiles.schema import RunProfile

# Whole name parts, so HF_TOKEN and WANDB_API_KEY are secrets but TOKENIZERS_PARALLELISM is not.
_SECRET_PARTS = {"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS"}
_SECRET_SUFFIX = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD)$")
REDACTED = "***"


class EnvValue(BaseModel):
    value: str = Field(..., description="The value the run uses.")
    source: Literal["profile", "user"] = Field(..., description="`user`: exported before the run; wins.")


class RuntimeEnv(BaseModel):
    values: dict[str, EnvValue] = Field(default_factory=dict, description="Final env vars and their sources.")
    driver_only: list[str] = Field(
        default_factory=list,
        description="Variables set on the driver but not forwarded to workers (Ray assigns device "
        "visibility per worker).",
    )

    @property
    def worker_env(self) -> dict[str, str]:
        """What goes into Ray's runtime_env: everything but secrets and driver-only variables.
        Secrets stay out because the runtime_env ends up in the job's command line and metadata."""
        return {
            name: item.value
            for name, item in self.values.items()
            if name not in self.driver_only and not is_secret(name)
        }

    def redacted(self) -> dict[str, dict[str, str]]:
        return {
            name: {"value": redact(name, item.value), "source": item.source} for name, item in sorted(self.values.items())
        }


def is_secret(name: str) -> bool:
    upper = name.upper()
    return bool(_SECRET_PARTS.intersection(upper.split("_")) or _SECRET_SUFFIX.search(upper))


def redact(name: str, value: str) -> str:
    return REDACTED if is_secret(name) else value


def resolve_environment(profile: RunProfile, environ: dict[str, str] | None = None) -> RuntimeEnv:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, EnvValue] = {}
    for name, default in profile.env.items():
        if name in environ:
            values[name] = EnvValue(value=environ[name], source="user")
        else:
            values[name] = EnvValue(value=default, source="profile")
    visible = profile.platform.visible_devices_var
    return RuntimeEnv(values=values, driver_only=[visible] if visible in values else [])
