"""Build a `RunProfile` from its layers and validate it.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --set engine.pp=8 --dry-run

Layers, lowest to highest: the device platform (`profiles/devices/<kind>.yaml`), the model recipe
(its `common` block, then its `devices.<kind>` block), a user profile file, `--set` overrides, and
explicit flow parameters (backend). Every layer is a partial `RunProfile` in the same shape; each
is checked for unknown keys on its own, so an error can say which layer holds the typo.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from grpo_pipeline.store.bounded_read import short
from grpo_pipeline.errors import ProfileError, headline_and_details
from grpo_pipeline.profiles.backend_table import BACKEND_TABLE, without_accelerators
from grpo_pipeline.profiles.engine import ENGINES
from grpo_pipeline.profiles.hf_config import architecture_from_hf_config
from grpo_pipeline.profiles.hub_config import hub_architecture, is_repo_id
from grpo_pipeline.profiles.schema import DeviceKind, ModelSection, Platform, RunProfile
from grpo_pipeline.profiles.section import section_types
from grpo_pipeline.profiles.secrets import secret_literal_problems, secrets_of
from grpo_pipeline.profiles.validation import validate_profile
from grpo_pipeline.profiles.yaml_files import load_yaml_mapping, load_yaml_text, path_kind

PROFILES_DIR = Path(__file__).resolve().parent
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)


def platform_for(kind: str) -> Platform:
    """The device table's row for a kind (`profiles/devices/<kind>.yaml`)."""
    layer = load_yaml_mapping(PROFILES_DIR / "devices" / f"{kind}.yaml", "device profile")
    return Platform.model_validate(layer.get("platform") or {})


def builtin_models() -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / "models").glob("*.yaml"))


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` wins; nested mappings are merged key by key, everything else is replaced."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(item: str) -> tuple[str, Any]:
    """`engine.tp=4` -> ("engine.tp", 4). The value is read as YAML, so `true`, `[a, b]` work.
    Errors name the key, never the value (it may be a secret)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        # Whatever follows the key-like start may be a value: it is not echoed.
        start = re.match(r"[A-Za-z0-9_.]*", item.strip()).group(0)
        shown = repr(start) if start == item.strip() else f"'{start}...' (the rest not shown: it may be a secret)"
        raise ProfileError(f"--set {shown} is not KEY=VALUE; write e.g. --set engine.tp=4")
    try:
        value = load_yaml_text(raw, f"--set {key}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def overrides_to_layer(overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides)
    layer: dict[str, Any] = {}
    for dotted, value in items:
        node = layer
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ProfileError(f"--set {dotted}: conflicts with another --set of {part}")
        node[leaf] = value
    return layer


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        if prefix + name not in keys:
            keys.append(prefix + name)
        for sub in section_types(field.annotation):
            keys.extend(key for key in _known_keys(sub, f"{prefix}{name}.") if key not in keys)
    return keys


def check_keys(layer: dict[str, Any], origin: str, models: tuple[type[BaseModel], ...] = (RunProfile,),
               prefix: str = "") -> None:
    """Reject keys the schema does not know, naming the layer and the closest real key (a key of either
    training engine is known here; the engine section's own validation refuses one under the other)."""
    for key, value in layer.items():
        field = next((model.model_fields[key] for model in models if key in model.model_fields), None)
        if field is None:
            dotted = prefix + key
            close = difflib.get_close_matches(dotted, _known_keys(RunProfile), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; see docs/profiles.md for the settings"
            raise ProfileError(f"unknown setting '{dotted}' in {origin}{hint}")
        subs = [sub for model in models if key in model.model_fields for sub in section_types(model.model_fields[key].annotation)]
        if subs and isinstance(value, dict):
            check_keys(value, origin, tuple(subs), f"{prefix}{key}.")


def model_layers(model: str, device: str) -> list[tuple[str, dict[str, Any]]]:
    """The recipe layers for `model` on `device`: a built-in recipe name or a local HF directory."""
    if model in builtin_models():
        recipe = load_yaml_mapping(PROFILES_DIR / "models" / f"{model}.yaml", "model recipe")
        devices = recipe.get("devices") or {}
        if device not in devices:
            raise ProfileError(
                f"model recipe '{model}' has no settings for device '{device}'; it supports "
                f"{', '.join(devices)}: pass --device {next(iter(devices), 'gpu')}"
            )
        return [
            (f"model recipe {model} (common)", recipe.get("common") or {}),
            (f"model recipe {model} (devices.{device})", devices[device] or {}),
        ]
    model_dir = Path(model).expanduser()
    if path_kind(model_dir, "--model") == "dir":
        layer = {
            "model": {
                "name": "custom",
                "path": str(model_dir.resolve()),
                "architecture": architecture_from_hf_config(model_dir),
            }
        }
        return [(f"model directory {model_dir}", layer)]
    if is_repo_id(model):
        # A hub repo id: its architecture comes from a profile file or --set, else from the repo's own
        # config.json once the user's layers are known (resolve_run_profile).
        return [(f"model {model}", {"model": {"name": "custom", "path": model}})]
    raise ProfileError(
        f"unknown model '{model}': not a built-in recipe ({', '.join(builtin_models())}) "
        "nor a directory with config.json"
    )


def resolve_profile(
    model: str,
    device: str,
    backend: str = "auto",
    profile_file: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> RunProfile:
    """Merge the layers for (model, device), check the rules that hold for any backend, and return the
    run's profile (stages/plan.py `resolve_profile` adds the backend's rules)."""
    return resolve_run_profile(model, device, backend, profile_file, overrides)[0]


def choose_backend(layers: list[tuple[str, dict[str, Any]]], requested: str, device: str) -> tuple[str, str]:
    """The training backend and why, in words for the run's log. `--backend <name>` is taken as
    asked, and so is a `backend` set in a profile file or --set. Otherwise (`auto`) a recipe gets its
    own backend, unless that backend needs accelerators (profiles/backend_table.py) and the device has
    none: then the table's backend that runs without them trains it."""
    if requested != "auto":
        return requested, f"--backend {requested}"
    fallback = without_accelerators()
    chosen, origin = fallback.name, "the default"
    for layer_origin, layer in layers:
        if "backend" in layer:
            chosen, origin = layer["backend"], layer_origin
    if not origin.startswith("model recipe") or chosen not in BACKEND_TABLE:
        return chosen, f"backend: {chosen} in {origin}"
    recipe, card = origin.split(" (")[0], BACKEND_TABLE[chosen]
    if not card.needs_accelerators:
        return chosen, f"{recipe} trains with the {chosen} backend"
    if platform_for(device).accelerated:
        return chosen, f"{recipe} trains with the {chosen} backend ({card.description}), and device {device} has accelerators"
    return fallback.name, (f"{recipe} trains with {chosen}, which needs GPUs or NPUs: on device {device} the "
                           f"{fallback.name} backend trains it")


def resolve_run_profile(
    model: str,
    device: str,
    backend: str = "auto",
    profile_file: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    validate: bool = True,
    detected: dict[str, Any] | None = None,
) -> tuple[RunProfile, str]:
    """`resolve_profile`, and why the profile has its backend (`choose_backend`). `validate=False`
    skips the rules across fields (a layout search starts from a layout that may not be valid). The
    backend's own rules (its layout, batches over its ranks) are added where plans are checked:
    stages/plan.py `checked_profile`. `detected` is what the backend takes from this host's devices
    (`Backend.detected_layer`): it sits just above the device profile, so a recipe, a profile file or
    --set still wins over it."""
    if device not in DEVICE_KINDS:
        raise ProfileError(f"unknown device '{device}'; use one of {', '.join(DEVICE_KINDS)}")
    layers = [(f"device profile {device}", load_yaml_mapping(PROFILES_DIR / "devices" / f"{device}.yaml", "device profile"))]
    if detected:
        layers.append(("the devices found on this host", detected))
    layers += model_layers(model, device)
    given = len(layers)  # the layers from here on are the user's
    layers += _user_layers(profile_file, overrides)
    chosen, reason = choose_backend(layers, backend, device)
    layers.append(("--backend", {"backend": chosen}))

    merged: dict[str, Any] = {}
    known = secrets_of()
    for index, (origin, layer) in enumerate(layers):
        # Before anything that may echo a setting (an unknown key, an invalid value). A built-in
        # layer's words ("console") are not compared with the secrets' values: a weak one may match.
        if problems := secret_literal_problems(layer, origin, known if index >= given else {}):
            raise ProfileError("; ".join(problems))
        check_keys(layer, origin)
        merged = deep_merge(merged, layer)
    model_section = merged.get("model") or {}
    if "architecture" not in model_section and is_repo_id(str(model_section.get("path", ""))):
        section = ModelSection.model_fields
        merged = deep_merge(merged, {"model": {"architecture": hub_architecture(
            model_section["path"], model_section.get("revision", section["revision"].default),
            model_section.get("root", section["root"].default))}})
    try:
        profile = RunProfile.model_validate(merged)
    except ValidationError as exc:
        raise ProfileError(describe_validation_error(exc)) from None
    if validate:
        validate_profile(profile)
    return profile, reason


def _user_layers(profile_file: str | Path | None, overrides: list[str] | dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    layers = [(f"profile file {profile_file}", load_yaml_mapping(Path(profile_file), "profile file"))] if profile_file else []
    return layers + ([("--set", overrides_to_layer(overrides))] if overrides else [])


def given_settings(model: str, device: str, profile_file: str | Path | None = None,
                   overrides: list[str] | dict[str, Any] | None = None) -> frozenset[str]:
    """The dotted names of the settings a recipe (or a model directory's config), a profile file or --set gives:
    what wins over the layer a backend takes from this host's devices (`detected`), which must decide the rest
    knowing them (the local backend's micro batch and gradient checkpointing: backends/local/sizing.py)."""
    names: set[str] = set()

    def walk(layer: dict[str, Any], prefix: str) -> None:
        for key, value in layer.items():
            walk(value, f"{prefix}{key}.") if isinstance(value, dict) else names.add(f"{prefix}{key}")

    for _, layer in model_layers(model, device) + _user_layers(profile_file, overrides):
        walk(layer, "")
    return frozenset(names)


def describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in _without_union_tags(error["loc"]))
        if error["type"] == "union_tag_invalid":  # a strategy no engine has: named as a Literal's would be
            ctx = error["ctx"]
            discriminator = ctx["discriminator"].strip("'()")  # pydantic writes `strategy()` for a callable one
            expected = " or ".join(ctx["expected_tags"].rsplit(", ", 1))
            problems.append(f"{field}.{discriminator}={ctx['tag']!r}: input should be {expected}")
        elif error["type"] == "missing":
            problems.append(f"{field} is required")
        else:
            message = error["msg"].removeprefix("Value error, ")
            message = message[0].lower() + message[1:]
            value = error.get("input")
            # Never echo env values (they may hold secrets) or whole sections.
            if field.startswith("env") or isinstance(value, dict):
                # A section's own rule names its fields itself.
                problems.append(message if message.startswith(f"{field}.") else f"{field}: {message}")
            else:
                problems.append(f"{field}={short(repr(value))}: {message}{_form_hint(field, error, value)}")
    return headline_and_details(problems, "invalid profile: ")


def _without_union_tags(loc: tuple) -> list:
    """pydantic names the member of a discriminated union in an error's location (`engine.fsdp.tp`);
    the setting is `engine.tp`."""
    return [part for index, part in enumerate(loc) if not (index and loc[index - 1] == "engine" and part in ENGINES)]


def _form_hint(field: str, error: dict, value: Any) -> str:
    """How to write a value of the right shape on the command line (YAML's list form), where the value
    given was one item of it."""
    if error["type"] == "list_type" and isinstance(value, (str, int, float)):
        return f"; write a list: --set '{field}=[{value}]'"
    return ""
