"""Build a `RunProfile` from its layers and validate it.

    python -m flows.grpo --model qwen3.5-122b-a10b --device npu --set engine.pp=8 --dry-run

Layers, lowest to highest: the device platform (`profiles/devices/<kind>.yaml`), the model recipe
(its `common` block, then its `devices.<kind>` block), a user profile file, `--set` overrides, and
explicit flow parameters (backend). Every layer is a partial `RunProfile` in the same shape; each
is checked for unknown keys on its own, so an error can say which layer holds the typo.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from profiles.errors import ProfileError
from profiles.schema import DeviceKind, RunProfile
from profiles.secrets import secret_literal_problems
from profiles.validation import validate_profile

PROFILES_DIR = Path(__file__).resolve().parent
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
# What one profile file may hold: far more than any real profile, far less than a parser bomb.
MAX_PROFILE_BYTES = 1 << 20
MAX_YAML_VALUES = 20_000


def builtin_models() -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / "models").glob("*.yaml"))


def path_kind(path: Path, what: str) -> str | None:
    """"file", "dir" or None (nothing there), for a path the user gave; a path the system refuses to
    look at (a name too long, no permission) is a ProfileError naming it, not a traceback."""
    try:
        if path.is_dir():
            return "dir"
        return "file" if path.exists() else None
    except OSError as exc:
        raise ProfileError(f"{what} {_shown(path)}: {exc.strerror or exc}; give a shorter or accessible path") from None


def _shown(path: Path | str, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text)} characters)"


def load_yaml_text(text: str, what: str) -> Any:
    """YAML, refused when its anchors and aliases would expand past MAX_YAML_VALUES values (a
    "billion laughs" document is a few lines that expand to billions), or refer to themselves."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded_values(node, {}) > MAX_YAML_VALUES:
            raise ProfileError(
                f"{what} expands to more than {MAX_YAML_VALUES:,} values through YAML anchors and aliases (or an "
                "alias refers to itself); a profile is a few hundred settings: write them out"
            )
        return yaml.safe_load(text)
    except RecursionError:
        raise ProfileError(f"{what} is nested too deeply to be a profile") from None


def _expanded_values(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values the node stands for once every alias is expanded (shared nodes counted
    once per use), capped just above the limit."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = MAX_YAML_VALUES + 1  # met again while being counted: an alias to itself
    total = 1
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
    for child in children:
        total += _expanded_values(child, sizes)
        if total > MAX_YAML_VALUES:
            break
    sizes[key] = min(total, MAX_YAML_VALUES + 1)
    return sizes[key]


def load_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    kind = path_kind(path, what)
    if kind != "file":
        raise ProfileError(f"{what} {_shown(path)} {'is a directory' if kind else 'does not exist'}; give the path of a YAML file")
    try:
        raw = path.read_bytes()[: MAX_PROFILE_BYTES + 1]
    except OSError as exc:
        raise ProfileError(f"{what} {_shown(path)}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{what} {_shown(path)} is larger than {MAX_PROFILE_BYTES >> 10} KiB; a profile is a few hundred settings")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{what} {_shown(path)} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                           f"{exc.start}); save it as UTF-8") from None
    try:
        data = load_yaml_text(text, f"{what} {_shown(path)}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ProfileError(f"{what} {_shown(path)} is not valid YAML{where}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(
            f"{what} {_shown(path)} must be a YAML mapping of settings (e.g. `engine: {{tp: 2}}`), "
            f"not a {type(data).__name__}"
        )
    return data


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
        keys.append(prefix + name)
        sub = section_type(field.annotation)
        if sub is not None:
            keys.extend(_known_keys(sub, f"{prefix}{name}."))
    return keys


def section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None:
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def check_keys(layer: dict[str, Any], origin: str, model: type[BaseModel] = RunProfile, prefix: str = "") -> None:
    """Reject keys the schema does not know, naming the layer and the closest real key."""
    for key, value in layer.items():
        field = model.model_fields.get(key)
        if field is None:
            dotted = prefix + key
            close = difflib.get_close_matches(dotted, _known_keys(RunProfile), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; see docs/profiles.md for the settings"
            raise ProfileError(f"unknown setting '{dotted}' in {origin}{hint}")
        sub = section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            check_keys(value, origin, sub, f"{prefix}{key}.")


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a local HF directory, as a JSON object, or a ProfileError saying what is wrong."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ProfileError(f"model directory {_shown(model_dir)}: cannot read config.json ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProfileError(f"model directory {_shown(model_dir)}: config.json is not JSON text; "
                           "give the directory of a Hugging Face model") from None
    if not isinstance(config, dict):
        raise ProfileError(f"model directory {_shown(model_dir)}: config.json holds a JSON {type(config).__name__}, "
                           "not the object of a Hugging Face config")
    return config


def architecture_from_hf_config(model_dir: Path) -> dict[str, Any]:
    """Architecture numbers from a local HF directory's config.json (text_config for multimodal)."""
    config = read_hf_config(model_dir)
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ProfileError(f"model directory {_shown(model_dir)}: config.json's text_config is a "
                           f"{type(text).__name__}, not an object")
    try:
        found = {
            "num_layers": text["num_hidden_layers"],
            "num_attention_heads": text["num_attention_heads"],
            "num_kv_heads": text.get("num_key_value_heads", text["num_attention_heads"]),
            "num_experts": text.get("num_experts") or text.get("num_local_experts") or 0,
            "hidden_size": text["hidden_size"],
            "vocab_size": text["vocab_size"],
            "linear_num_key_heads": text.get("linear_num_key_heads"),
            "linear_num_value_heads": text.get("linear_num_value_heads"),
        }
    except KeyError as exc:
        raise ProfileError(f"model directory {_shown(model_dir)}: config.json has no {exc.args[0]}") from None
    wrong = [name for name, value in found.items()
             if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0)]
    if wrong:
        raise ProfileError(f"model directory {_shown(model_dir)}: config.json's {', '.join(wrong)} must be whole numbers")
    return found


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
    if "/" in model and not model.startswith((".", "/", "~")):
        # A hub repo id: its config is not read here (no network before fetch); the architecture
        # must come from a profile file or --set so the layout can still be validated.
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
    """Merge the layers for (model, device), validate, and return the run's profile."""
    if device not in DEVICE_KINDS:
        raise ProfileError(f"unknown device '{device}'; use one of {', '.join(DEVICE_KINDS)}")
    layers = [(f"device profile {device}", load_yaml_mapping(PROFILES_DIR / "devices" / f"{device}.yaml", "device profile"))]
    layers += model_layers(model, device)
    if profile_file:
        layers.append((f"profile file {profile_file}", load_yaml_mapping(Path(profile_file), "profile file")))
    if overrides:
        layers.append(("--set", overrides_to_layer(overrides)))
    if backend != "auto":
        layers.append(("--backend", {"backend": backend}))

    merged: dict[str, Any] = {}
    for origin, layer in layers:
        check_keys(layer, origin)
        if problems := secret_literal_problems(layer.get("env"), origin):
            raise ProfileError("; ".join(problems))
        merged = deep_merge(merged, layer)
    try:
        profile = RunProfile.model_validate(merged)
    except ValidationError as exc:
        raise ProfileError(describe_validation_error(exc)) from None
    validate_profile(profile)
    return profile


def describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            hint = " (a model given by repo id needs model.architecture.* in a profile file)" if "architecture" in field else ""
            problems.append(f"{field} is required{hint}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            message = message[0].lower() + message[1:]
            value = error.get("input")
            # Never echo env values (they may hold secrets) or whole sections.
            if field.startswith("env") or isinstance(value, dict):
                problems.append(f"{field}: {message}")
            else:
                problems.append(f"{field}={value!r}: {message}")
    return "invalid profile: " + "; ".join(problems)
