"""Secrets: which variables hold one, how a profile names one without its value, and the one
redaction that every place a profile, an environment or an error is shown or stored goes through.

    python -m flows.grpo --model tiny --device cpu --set 'env.HF_TOKEN=${HF_TOKEN}' --dry-run

The rule: a secret's value lives only in the environment of the process that runs the flow (the
shell of a CLI run, a Prefect worker's environment for a deployment). A profile layer, a `--set`
override or a flow parameter may name a secret only by reference, `${NAME}`: Prefect stores flow
parameters and shows them in its UI, and the resolved profile is written to profile.yaml, the
report and Prefect artifacts. The stages that use a token (hub downloads) run in the flow's
process, which has it. The Ray `runtime_env` never carries one (Ray keeps it in its GCS and shows it
in the dashboard): a process on another node that needs one reads its own node's environment
(export it before `ray start` there; Ray workers inherit the raylet's environment).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
# Whole name parts, so HF_TOKEN and WANDB_API_KEY are secrets but TOKENIZERS_PARALLELISM is not.
_SECRET_PARTS = {"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS"}
_SECRET_SUFFIX = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD)$")
# A whole value that refers to another variable: `${NAME}` or `${NAME:-default}`.
REFERENCE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")
# user:password@ in any URL (proxies, mirrors, Ray addresses).
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")
# Shorter values (`1`, `true`) would scrub ordinary words out of every message.
_MIN_SCRUBBED_LENGTH = 6


def is_secret(name: str) -> bool:
    upper = name.upper()
    return bool(_SECRET_PARTS.intersection(upper.split("_")) or _SECRET_SUFFIX.search(upper))


def parse_reference(value: str) -> tuple[str, str | None] | None:
    """(name, default) when the whole value is a reference, else None."""
    found = REFERENCE.fullmatch(value.strip()) if isinstance(value, str) else None
    return (found["name"], found["default"]) if found else None


def secret_literal_problems(env: Any, where: str) -> list[str]:
    """What in an `env` mapping of a profile layer would store a secret's value; never the value."""
    if not isinstance(env, Mapping):
        return []
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not is_secret(name):
            continue
        reference = parse_reference(value) if isinstance(value, str) else None
        if reference is None or reference[1] is not None:
            literal = "a default value in its reference (a literal too)" if reference else "a literal value"
            problems.append(
                f"{where}: env.{name} holds {literal}; a secret is read from the environment of the process that "
                f"runs the flow: export {name} there and write env.{name}=${{{name}}} (or leave it out)"
            )
    return problems


def redact(name: str, value: str | None) -> str | None:
    """An environment value as it may be shown: a secret's is `***`, a URL's credentials are hidden."""
    if value is None:
        return None
    if is_secret(name):
        return REDACTED
    return redact_url_credentials(value)


def redact_url_credentials(text: str) -> str:
    return _URL_CREDENTIALS.sub(f"{REDACTED}@", text)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret-named variables of this process, longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if is_secret(k) and len(v or "") >= _MIN_SCRUBBED_LENGTH}
    return sorted(found, key=len, reverse=True)


def scrub(text: str, values: Iterable[str] | None = None) -> str:
    """Text with every secret value of this process (and URL credentials) replaced by `***`: the
    last guard before a message is printed, logged or stored."""
    for value in secret_values() if values is None else values:
        text = text.replace(value, REDACTED)
    return redact_url_credentials(text)


def _anycase(word: str) -> str:
    """A regex that matches `word` in any case, written with classes (no inline flags: JSON-schema
    patterns are checked by engines that lack scoped ones)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in word)


def secret_name_pattern() -> str:
    """A regex of the variable names `is_secret` calls secrets (for a form's JSON-schema pattern)."""
    parts = "|".join(_anycase(part) for part in sorted(_SECRET_PARTS, key=len, reverse=True))
    suffixes = "|".join(_anycase(s) for s in _SECRET_SUFFIX.pattern.strip("()$").split("|"))
    return rf"(?:(?:[A-Za-z0-9]*_)*(?:{parts})(?:_[A-Za-z0-9_]*)?|[A-Za-z0-9_]*(?:{suffixes}))"


URL_CREDENTIALS_PATTERN = _URL_CREDENTIALS.pattern.replace("(?<=://)", "://")
