"""Secrets: which values are one, how a profile names one without its value, and the one redaction
that every place a profile, an environment or a message is shown or stored goes through.

    python -m grpo_pipeline --model tiny --device cpu --set 'env.MIRROR_AUTH=${HF_TOKEN}' --dry-run

The rule: a secret's value lives only in the environment of the process that runs the flow (the
shell of a CLI run, a Prefect worker's environment for a deployment). A profile layer, a `--set`
override or a flow parameter may name a secret only by reference, `${NAME}`: Prefect stores flow
parameters and shows them in its UI, and the resolved profile is written to profile.yaml, plan.json,
the report and Prefect artifacts. The stages that use a token (hub downloads) run in the flow's
process, which has it. The Ray `runtime_env` never carries one (Ray keeps it in its GCS, logs it and
shows it in the dashboard): a process on another node that needs one reads its own node's
environment (export it before `ray start` there; Ray workers inherit the raylet's environment).

What is a secret: a variable named like one (`is_secret`: HF_TOKEN, WANDB_API_KEY, DB_PASSWORD,
GITHUB_PAT, MY_AUTH, SENTRY_DSN, ...; a name that ends in a location, SSL_CERT_FILE or SSH_AUTH_SOCK,
holds where a secret is, not one); any env entry whose value is read from the environment by a
`${REFERENCE}`, whatever the names, unless the profile lists the entry in `public_env` (so a secret
under a name this module does not know fails safe); and a value with credentials in a URL
(`scheme://user:pass@host`, the `@` %-escaped too). Only env values are references: any other
setting (data.source, model.path, trainer.entrypoint) is stored and used as written, so credentials
in a URL there are refused, as they are in a literal env value, and so is any value under a
secret-named key outside env (`tracking.wandb.api_key=...`), which no setting of the profile is.
"""

from __future__ import annotations

import functools
import os
import re
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

REDACTED = "***"
# Whole name parts, so HF_TOKEN and WANDB_API_KEY are secrets but TOKENIZERS_PARALLELISM is not.
_SECRET_PARTS = {"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "PASSPHRASE", "CREDENTIAL",
                 "CREDENTIALS", "CREDS", "PAT", "AUTH", "OAUTH", "AUTHORIZATION", "BEARER", "JWT", "COOKIE", "COOKIES",
                 "SESSION", "SESSIONID", "DSN", "PRIVATE", "CERT"}
_SECRET_SUFFIX = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD)S?[0-9]*$")
# A part in the plural or numbered is the same secret (HF_TOKENS, API_KEYS, GH_TOKEN2, PASSWORD1), except a
# plural counted by the part before it (MAX_TOKENS, NUM_KEYS: a number of tokens, not tokens).
_COUNTING_PARTS = ("MAX", "MIN", "NUM", "TOTAL")
# A last part that says the value is a location (SSL_CERT_FILE, SSH_AUTH_SOCK, HF_TOKEN_PATH): where a
# secret or a public certificate is, which tools print in their messages, not the secret itself.
_LOCATION_PARTS = ("FILE", "DIR", "PATH", "SOCK")
# A whole value that refers to another variable: `${NAME}` or `${NAME:-default}`.
REFERENCE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")
# user:password@ (or a token as the user) in any URL: proxies, mirrors, databases, Ray addresses. The
# `@` %-escaped (`ray://u:pw%40head`) still ends credentials: a client that unescapes it sends them.
_URL_CREDENTIALS = re.compile(r"(?<=://)([^/@\s]+)(?:@|%40)")
# Shorter values (`1`, `true`) would scrub ordinary words out of every message.
_MIN_SCRUBBED_LENGTH = 6
_AS_WRITTEN = "the setting is stored and shown as written (only env values are references)"
_SETTING_NAME = re.compile(r"[A-Za-z0-9_-]+")
# Variables of this process that hold a secret whatever their name: the ones a secret env entry of a
# resolved profile reads (`env.MY_PASSWORD=${PW_VAR}`), and the entries themselves (stages/environment.py).
_HELD_BY_REFERENCE: set[str] = set()


def is_secret(name: str) -> bool:
    upper = name.upper()
    if upper.rsplit("_", 1)[-1] in _LOCATION_PARTS and "_" in upper:
        return False
    parts = upper.split("_")
    return any(_names_secret(part, parts[i - 1] if i else "") for i, part in enumerate(parts)) or _suffix(upper)


def _names_secret(part: str, before: str) -> bool:
    stem = part.rstrip("0123456789")
    return stem in _SECRET_PARTS or (stem[-1:] == "S" and stem[:-1] in _SECRET_PARTS and before not in _COUNTING_PARTS)


def _suffix(upper: str) -> bool:
    found = _SECRET_SUFFIX.search(upper)
    counted = found is not None and found[0].rstrip("0123456789").endswith("S") and any(
        upper[:found.start()].endswith(f"{word}_") for word in _COUNTING_PARTS)
    return found is not None and not counted


def parse_reference(value: str) -> tuple[str, str | None] | None:
    """(name, default) when the whole value is a reference, else None."""
    found = REFERENCE.fullmatch(value.strip()) if isinstance(value, str) else None
    return (found["name"], found["default"]) if found else None


def is_secret_entry(name: str, value: Any) -> bool:
    """An env entry that names a secret: by its own name, or by the variable its reference reads."""
    reference = parse_reference(value)
    return is_secret(name) or (reference is not None and is_secret(reference[0]))


def has_url_credentials(text: str) -> bool:
    return bool(_URL_CREDENTIALS.search(text))


def is_secret_value(value: str, environ: Mapping[str, str] | None = None) -> bool:
    """A value with credentials in a URL, or that holds a secret value of the environment (`secrets_of`)."""
    return has_url_credentials(value) or _holder(value, secrets_of(environ)) is not None


def secret_literal_problems(layer: Any, where: str, values: Mapping[str, str] | None = None) -> list[str]:
    """What in a profile layer would store a secret's value, each naming the setting, never the value:
    a secret env entry that is not a bare reference, credentials in a URL anywhere, and any of this
    process's secret values (`values`: value -> the variable that holds it, default `secrets_of()`),
    e.g. an unquoted `$HF_TOKEN` that the shell expanded into a `--set`."""
    if not isinstance(layer, Mapping):
        return []
    known = secrets_of() if values is None else values
    problems = []
    env = layer.get("env") if isinstance(layer.get("env"), Mapping) else {}
    for name, value in env.items():
        if not isinstance(name, str) or not _SETTING_NAME.fullmatch(name):
            continue  # no variable's name: checked below as a key, and refused by the schema
        reference = parse_reference(value)
        source = reference[0] if reference else name
        written = "\n".join(text for _, text in _strings(value, ""))  # a value that is no string is refused later, unshown
        if is_secret_entry(name, value) and (reference is None or reference[1] is not None):
            literal = "a default value in its reference (a literal too)" if reference else "a literal value"
            problems.append(
                f"{where}: env.{name} holds {literal}; a secret is read from the environment of the process that "
                f"runs the flow: export {source} there and write env.{name}=${{{source}}} (or leave it out)"
            )
        elif has_url_credentials(written):
            problems.append(
                f"{where}: env.{name} holds credentials in a URL; a profile is stored and shown as written: export "
                f"{source} where the flow runs and write env.{name}=${{{source}}}"
            )
        elif holder := _holder(written, known):
            problems.append(
                f"{where}: env.{name} holds the value of {holder}; write env.{name}=${{{holder}}} (on a command line "
                f"in single quotes: the shell expands an unquoted ${holder})"
            )
    for setting in _secret_named_settings(layer):
        if not _is_setting(setting):  # a typo is told as one; its value stays unshown all the same
            problems.append(f"{where}: {setting} is no setting of the profile (docs/profiles.md lists them); its name "
                            "is a secret's, so its value is neither shown nor stored")
            continue
        problems.append(
            f"{where}: {setting} names a secret, and a setting is stored and shown as written: export the secret "
            "where the flow runs and name it in an env entry (env.NAME=${NAME})"
        )
    for setting, text in _strings(layer, ""):
        if env and setting.startswith("env."):
            continue  # an env entry: checked above, with its own fix
        if has_url_credentials(text):
            problems.append(
                f"{where}: {setting} holds credentials in a URL; {_AS_WRITTEN}: put a hub token in HF_TOKEN (export "
                "it; downloads send it), other credentials in an exported variable that an env entry references "
                "(env.NAME=${NAME})"
            )
        elif holder := _holder(text, known):
            problems.append(f"{where}: {setting} holds the value of {holder}; {_AS_WRITTEN}: keep it in the environment only")
    return problems


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(setting, text) for every string of a layer, keys included: a key that is not a setting's
    name is named by its parent, never shown."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _strings(key, f"a key of {path or 'the profile'}")
            key = key if _SETTING_NAME.fullmatch(str(key)) else "<key>"
            yield from _strings(value, f"{path}.{key}" if path else key)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _strings(value, f"{path}[{index}]")


def _secret_named_settings(layer: Mapping) -> list[str]:
    """Settings outside `env` whose key names a secret (`tracking.wandb.api_key`, `hf_token`,
    `evn.HF_TOKEN`, `rollout.vllm_kwargs.hf_token`) and that hold anything but a bare reference: no
    setting of the profile is one (`secret_key_exemptions` has those that only look like one)."""
    exact, free = secret_key_exemptions()
    found: list[str] = []

    def walk(node: Any, keys: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                if not (keys == () and key == "env" and isinstance(value, Mapping)):  # env entries: their own rule
                    walk(value, (*keys, str(key)))
            return
        if isinstance(node, (list, tuple)) and node:
            for value in node:
                walk(value, keys)
            return
        reference = parse_reference(node) if isinstance(node, str) else None
        setting = ".".join(key if _SETTING_NAME.fullmatch(key) else "<key>" for key in keys)
        if _names_a_secret(keys, exact, free) and setting not in found and (reference is None or reference[1] is not None):
            found.append(setting)

    walk(layer, ())
    return found


def _names_a_secret(keys: tuple[str, ...], exact: frozenset[str], free: tuple[str, ...]) -> bool:
    joined = ".".join(keys)
    prefix = next((p for p in free if joined.startswith(p + ".")), None)
    if prefix is not None:
        return any(names_a_credential(key) for key in keys[prefix.count(".") + 1:])
    return joined not in exact and any(is_secret(key) for key in keys)


def names_a_credential(name: str) -> bool:
    """A key of a free-form mapping (a megatron-core, vLLM or distribution name) that names a secret:
    one whose last part does (`hf_token`, `api_key`), not `moe_token_dispatcher_type`."""
    upper = name.upper()
    parts = upper.split("_")
    return _names_secret(parts[-1], parts[-2] if len(parts) > 1 else "") or _suffix(upper)


def _is_setting(setting: str) -> bool:
    """A dotted path the profile has (a key inside a free-form mapping counts: it is that mapping's)."""
    from grpo_pipeline.profiles.schema import RunProfile
    from grpo_pipeline.profiles.section import section_types

    sections = [RunProfile]
    for key in setting.split("."):
        fields = [section.model_fields[key] for section in sections if key in section.model_fields]
        if not fields:
            return False
        kinds = [kind for field in fields for kind in (field.annotation, *typing.get_args(field.annotation))]
        if any(typing.get_origin(kind) is dict for kind in kinds):
            return True
        sections = [section for field in fields for section in section_types(field.annotation)]
    return True


@functools.cache
def secret_key_exemptions() -> tuple[frozenset[str], tuple[str, ...]]:
    """Where the secret-named key rule looks at names differently: the profile's own settings whose
    names only look like a secret's (`actor.ppo_max_token_len_per_gpu`: tokens, not a token), left
    alone; and the free-form mappings (`engine.transformer_overrides`, `rollout.vllm_kwargs`, `requires`),
    whose keys are other programs' names, where only a key that names a credential (`names_a_credential`)
    counts."""
    from pydantic import BaseModel

    from grpo_pipeline.profiles.schema import RunProfile
    from grpo_pipeline.profiles.section import section_types

    exact, free = set(), []

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            keys = (*path, name)
            kinds = (field.annotation, *typing.get_args(field.annotation))
            if keys == ("env",):
                continue
            if any(typing.get_origin(kind) is dict for kind in kinds):
                free.append(".".join(keys))
            elif any(is_secret(key) for key in keys):
                exact.add(".".join(keys))
            for section in section_types(field.annotation):  # both training engines' sections, too
                walk(section, keys)

    walk(RunProfile, ())
    return frozenset(exact), tuple(free)


def _holder(text: str, values: Mapping[str, str]) -> str | None:
    return next((name for value, name in values.items() if value in text), None)


def hold_by_reference(names: Iterable[str]) -> None:
    """Treat these variables of this process as secrets whatever their names (`scrub` hides their values)."""
    _HELD_BY_REFERENCE.update(names)


def redact(name: str, value: str | None, secret: bool = False) -> str | None:
    """An environment value as it may be shown: a secret's (by its name, or `secret`) is `***`, a
    URL's credentials are hidden."""
    if value is None and not secret:
        return None
    if secret or is_secret(name):
        return REDACTED
    return redact_url_credentials(value)


def redact_url_credentials(text: str) -> str:
    return _URL_CREDENTIALS.sub(f"{REDACTED}@", text)


def secrets_of(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's secret values, each with the variable that holds it: the values of secret-named
    variables and of those a secret env entry reads, and the credentials inside any URL value (with
    and without its %-escapes)."""
    environ = os.environ if environ is None else environ
    found: dict[str, str] = {}
    for name, value in environ.items():
        if (is_secret(name) or name in _HELD_BY_REFERENCE) and not _names_a_place(value):
            found.setdefault(value, name)
            # Each line of a value with line breaks too: a client quotes a header's lines apart (h11 printed a
            # token's second line in its error), and a message cut at a line still holds the rest.
            for line in value.splitlines():
                found.setdefault(line.strip(), name)
        for userinfo in _URL_CREDENTIALS.findall(value):
            for part in (userinfo, userinfo.partition(":")[2]):
                found.setdefault(part, name)
                found.setdefault(unquote(part), name)
    return {value: name for value, name in found.items() if len(value) >= _MIN_SCRUBBED_LENGTH}


def _names_a_place(value: str) -> bool:
    """An absolute path that exists: where a secret (or a public certificate: PIP_CERT) is, not its value,
    and text that messages and settings name as it is (/etc/ssl/certs/ca-certificates.crt)."""
    return os.path.isabs(value) and os.path.exists(value)


def secret_holder(text: str) -> str | None:
    """The variable of this process whose secret value `text` holds (`secrets_of`), if any."""
    return _holder(text, secrets_of())


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """This process's secret values (`secrets_of`), longest first."""
    return sorted(secrets_of(environ), key=len, reverse=True)


def scrub(text: str, values: Iterable[str] | None = None) -> str:
    """Text with every secret value of this process (and URL credentials) replaced by `***`: the
    last guard before a message is printed, logged or stored."""
    for value in secret_values() if values is None else values:
        text = text.replace(value, REDACTED)
    return redact_url_credentials(text)


def secret_name_pattern(credential: bool = False) -> str:
    """A regex of the variable names `is_secret` calls secrets (`names_a_credential` with `credential`),
    for a form's JSON-schema pattern, which the Prefect API checks with Python's `re` (the scoped flag
    `(?i:...)` keeps it short enough to read). It matches a whole name where no name character follows."""
    names = "|".join(sorted(_SECRET_PARTS, key=len, reverse=True))
    counted = "".join(f"(?<!{word}_)" for word in _COUNTING_PARTS)
    # A part: a secret's name, numbered, or in the plural where no counting part stands before it.
    parts = rf"(?:(?:{names})[0-9]*|{counted}(?:{names})s[0-9]*)"
    suffixes = _SECRET_SUFFIX.pattern.split(")")[0].strip("(")
    suffix = rf"(?:(?:{suffixes})[0-9]*|{counted}(?:{suffixes})s[0-9]*)"
    places = "|".join(_LOCATION_PARTS)
    end = "(?![a-z0-9_])"
    if credential:
        return rf"(?i:(?:[a-z0-9]*_)*{parts}{end}|[a-z0-9_]*{suffix}{end})"
    return (rf"(?i:(?![a-z0-9_]*_(?:{places}){end})"
            rf"(?:(?:[a-z0-9]*_)*{parts}(?:_[a-z0-9_]*)?|[a-z0-9_]*{suffix}){end})")


URL_CREDENTIALS_PATTERN = _URL_CREDENTIALS.pattern.replace("(?<=://)", "://")
