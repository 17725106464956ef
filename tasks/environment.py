"""The `prepare_environment` stage: the environment every process of the run gets, on every node.

    python -m flows.grpo --model qwen3.5-122b-a10b --device npu --dry-run --json   # the "env" object

The profile's env (device platform + model recipe + user layers) is the default; a variable the
user already exported wins, as the upstream launcher's `${VAR:-default}` did, and the result records
which source each value came from. One explicit proxy step, the same for every device, follows the
profile's `proxy_policy`. The final values are applied to the driver and packed into the Ray
`runtime_env` that every backend uses, because an `export` in one shell never reaches Ray workers
on other nodes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, MutableMapping
from typing import Literal

from pydantic import BaseModel, Field

from profiles.schema import RunProfile

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

# Whole name parts, so HF_TOKEN and WANDB_API_KEY are secrets but TOKENIZERS_PARALLELISM is not.
_SECRET_PARTS = {"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS"}
_SECRET_SUFFIX = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD)$")
REDACTED = "***"


class EnvValue(BaseModel):
    value: str | None = Field(..., description="The value the run uses; null: the variable is removed.")
    source: Literal["profile", "user", "proxy-policy"] = Field(
        ..., description="`user`: exported before the run, and wins; `proxy-policy`: set by the proxy step."
    )


class RuntimeEnv(BaseModel):
    values: dict[str, EnvValue] = Field(default_factory=dict, description="Final env vars and their sources.")
    proxy_policy: str = Field("keep", description="The proxy policy applied.")
    proxy_actions: list[str] = Field(default_factory=list, description="What the proxy step changed.")
    driver_only: list[str] = Field(
        default_factory=list,
        description="Set on the driver but not forwarded to workers (Ray assigns device visibility per worker).",
    )

    @property
    def worker_env(self) -> dict[str, str]:
        """Ray runtime_env env_vars. Secrets stay out (a runtime_env lands in job metadata and command
        lines); a removed proxy becomes an empty value, which curl, requests and urllib read as none."""
        env = {}
        for name, item in self.values.items():
            if name in self.driver_only or is_secret(name):
                continue
            env[name] = "" if item.value is None else item.value
        return env

    def ray_runtime_env(self) -> dict:
        return {"env_vars": self.worker_env}

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Make the driver's environment the run's environment."""
        environ = os.environ if environ is None else environ
        for name, item in self.values.items():
            if item.value is None:
                environ.pop(name, None)
            else:
                environ[name] = item.value

    def redacted(self) -> dict[str, dict[str, str | None]]:
        return {
            name: {"value": redact(name, item.value), "source": item.source}
            for name, item in sorted(self.values.items())
        }


def is_secret(name: str) -> bool:
    upper = name.upper()
    return bool(_SECRET_PARTS.intersection(upper.split("_")) or _SECRET_SUFFIX.search(upper))


def redact(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    if is_secret(name):
        return REDACTED
    # Proxy URLs may carry credentials: http://user:password@proxy:3128
    return re.sub(r"(?<=://)[^/@\s]+@", f"{REDACTED}@", value)


def ray_head_host(ray_address: str | None) -> str | None:
    if not ray_address or ray_address in ("auto", "local"):
        return None
    address = re.sub(r"^[a-z]+://", "", ray_address).split("/", 1)[0]
    bracketed = re.match(r"\[([^\]]+)\]", address)  # [IPv6]:port
    if bracketed:
        return bracketed.group(1)
    return (address.rsplit(":", 1)[0] if address.count(":") == 1 else address) or None


def proxy_step(
    policy: str, environ: dict[str, str], cluster_hosts: Iterable[str]
) -> tuple[dict[str, EnvValue], list[str]]:
    """The variables the proxy policy sets or removes, and a record of what it did."""
    present = [name for name in PROXY_VARS if environ.get(name)]
    if policy == "keep":
        return {}, [f"kept {', '.join(present) or 'no proxy variables'} as they are"]
    if policy == "clear":
        actions = [f"removed {name}" for name in present] or ["no proxy variable was set"]
        actions.append("emptied every proxy variable on workers, both cases")
        return {name: EnvValue(value=None, source="proxy-policy") for name in PROXY_VARS}, actions
    # bypass-cluster: both spellings, because tools disagree on which one they read.
    existing = [h.strip() for name in NO_PROXY_VARS for h in environ.get(name, "").split(",") if h.strip()]
    hosts = list(dict.fromkeys([*existing, *LOCAL_HOSTS, *cluster_hosts]))
    added = [h for h in hosts if h not in existing]
    value = ",".join(hosts)
    actions = [f"NO_PROXY and no_proxy += {', '.join(added) or 'nothing (already listed)'}"]
    actions.append(f"kept {', '.join(present)} for the outside world" if present else "no proxy variable was set")
    return {name: EnvValue(value=value, source="proxy-policy") for name in NO_PROXY_VARS}, actions


def resolve_environment(
    profile: RunProfile,
    environ: dict[str, str] | None = None,
    ray_address: str | None = None,
    cluster_hosts: Iterable[str] = (),
) -> RuntimeEnv:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, EnvValue] = {}
    for name, default in profile.env.items():
        if name in environ:
            values[name] = EnvValue(value=environ[name], source="user")
        else:
            values[name] = EnvValue(value=default, source="profile")
    head = ray_head_host(ray_address or environ.get("RAY_ADDRESS"))
    proxy_values, actions = proxy_step(profile.proxy_policy, environ, [h for h in (head, *cluster_hosts) if h])
    values.update(proxy_values)
    visible = profile.platform.visible_devices_var
    return RuntimeEnv(
        values=values,
        proxy_policy=profile.proxy_policy,
        proxy_actions=actions,
        driver_only=[visible] if visible in values else [],
    )
