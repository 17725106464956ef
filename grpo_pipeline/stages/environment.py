"""The `prepare_environment` stage: the environment every process of the run gets, on every node.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run --json   # the "env" object

The profile's env (device platform + model recipe + user layers) is the default; a variable the
user already exported wins, as the upstream launcher's `${VAR:-default}` did, and the result records
which source each value came from. One explicit proxy step, the same for every device, follows the
profile's `proxy_policy`. The final values are applied to the driver and packed into the Ray
`runtime_env` that every backend uses, because an `export` in one shell never reaches Ray workers
on other nodes. A whole value `${NAME}` / `${NAME:-default}` is read from this process's
environment. Secrets are the exception to all of this (profiles/secrets.py: a secret-named entry,
any value read by reference unless the profile's `public_env` lists the entry, a value with
credentials in a URL): named only by reference, never held in a `RuntimeEnv` (so it can be stored
and shown as it is), applied to the driver alone and never put in the `runtime_env`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping
from typing import Literal

from pydantic import BaseModel, Field

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.secrets import hold_by_reference, is_secret, is_secret_entry, is_secret_value, parse_reference, redact
from grpo_pipeline.cluster.ray_address import parse_ray_address

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


class EnvValue(BaseModel):
    value: str | None = Field(..., description="The value the run uses; null: the variable is removed (or, for a "
                              "secret, never recorded).")
    source: Literal["profile", "user", "proxy-policy"] = Field(
        ..., description="`user`: exported before the run, and wins; `proxy-policy`: set by the proxy step."
    )
    secret_from: str | None = Field(
        None, description="A secret: the variable of the flow's process it is read from when applied; its value "
        "is never held here, so this value can be stored, logged and shown as it is.",
    )


class RuntimeEnv(BaseModel):
    values: dict[str, EnvValue] = Field(default_factory=dict, description="Final env vars and their sources.")
    proxy_policy: str = Field("keep", description="The proxy policy applied.")
    proxy_actions: list[str] = Field(default_factory=list, description="What the proxy step changed.")
    driver_only: list[str] = Field(
        default_factory=list,
        description="Set on the driver but not forwarded to workers (Ray assigns device visibility per worker).",
    )
    unset_references: list[str] = Field(
        default_factory=list, description="`NAME (${OTHER})`: references to variables this process does not have."
    )

    @property
    def worker_env(self) -> dict[str, str]:
        """Ray runtime_env env_vars. Secrets stay out (a runtime_env lands in Ray's GCS, job metadata and
        command lines; see profiles/secrets.py); a removed proxy becomes an empty value, which curl,
        requests and urllib read as none."""
        env = {}
        for name, item in self.values.items():
            if name in self.driver_only or is_secret(name) or item.secret_from:
                continue
            env[name] = "" if item.value is None else item.value
        return env

    def ray_runtime_env(self) -> dict:
        return {"env_vars": self.worker_env}

    def check_references(self) -> None:
        """A run (not a dry run) needs every variable its profile refers to."""
        if self.unset_references:
            raise ProfileError(
                f"env: {', '.join(self.unset_references)} refer(s) to a variable that is not set where the flow runs; "
                "export it there (for a deployment: in the worker's environment), or remove the entry"
            )

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Make the driver's environment the run's environment."""
        environ = os.environ if environ is None else environ
        for name, item in self.values.items():
            if item.secret_from:
                if item.secret_from in environ:
                    environ[name] = environ[item.secret_from]
            elif item.value is None:
                environ.pop(name, None)
            else:
                environ[name] = item.value

    def redacted(self) -> dict[str, dict[str, str | None]]:
        return {
            name: {"value": redact(name, item.value, secret=bool(item.secret_from)), "source": item.source}
            for name, item in sorted(self.values.items())
        }


def ray_head_host(ray_address: str | None) -> str | None:
    if not ray_address:
        return None
    address = parse_ray_address(ray_address, "RAY_ADDRESS")
    return address.host if address else None


def profile_value(name: str, value: str, environ: dict[str, str], public: Iterable[str] = ()) -> tuple[EnvValue | None, str | None]:
    """A profile's env entry as the run uses it, or why it cannot be: the exported variable of the
    same name wins (as `${VAR:-default}` did upstream); a `${OTHER}` / `${OTHER:-default}` value is
    read from the environment. A secret (profiles/secrets.py: the entry or the variable it reads is
    named like one, the value was read by reference and the entry is not in `public`, or the value
    read holds credentials in a URL or another secret's value) is held as the variable it is read
    from, never as its value; a secret-named one has no default (planning refuses one)."""
    reference = parse_reference(value)
    exported = name if name in environ else reference[0] if reference and reference[0] in environ else None
    if exported is not None:
        by_reference = reference is not None and name not in public
        if by_reference or is_secret_entry(name, value) or is_secret_value(environ[exported], environ):
            return EnvValue(value=None, source="user", secret_from=exported), None
        return EnvValue(value=environ[exported], source="user"), None
    if reference is None:
        return EnvValue(value=value, source="profile"), None
    if reference[1] is not None and not is_secret_entry(name, value):
        return EnvValue(value=reference[1], source="profile"), None
    return None, f"{name} (${{{reference[0]}}})"


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
    unset = []
    for name, default in profile.env.items():
        item, missing = profile_value(name, default, environ, profile.public_env)
        if item is None:
            unset.append(missing)
        else:
            values[name] = item
    # From here on this process's messages are scrubbed of them too, whatever their names.
    hold_by_reference(n for name, item in values.items() if item.secret_from for n in (name, item.secret_from))
    head = ray_head_host(ray_address or environ.get("RAY_ADDRESS"))
    proxy_values, actions = proxy_step(profile.proxy_policy, environ, [h for h in (head, *cluster_hosts) if h])
    values.update(proxy_values)
    visible = profile.platform.visible_devices_var
    return RuntimeEnv(
        values=values,
        proxy_policy=profile.proxy_policy,
        proxy_actions=actions,
        driver_only=[visible] if visible in values else [],
        unset_references=unset,
    )
