"""Write the profile reference (docs/profiles.md) from the schema's own descriptions.

    .venv/bin/python -m grpo_pipeline.profiles.reference > docs/profiles.md

A test regenerates it and compares, so the reference never drifts from the schema.
"""

from __future__ import annotations

import json
import sys
from typing import Literal, get_args, get_origin

from pydantic import BaseModel

from grpo_pipeline.profiles.loader import builtin_models
from grpo_pipeline.profiles.section import section_types
from grpo_pipeline.profiles.schema import RunProfile


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _type_name(annotation) -> str:
    if get_origin(annotation) is Literal:
        return " / ".join(str(arg) for arg in get_args(annotation))
    text = getattr(annotation, "__name__", None) if get_origin(annotation) is None else None
    return (text or str(annotation).replace("typing.", "")).replace("|", "or")


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    return [f"| `{key}` | {kind} | {default} | {description} |" for key, (kind, default, description) in _settings(model, prefix).items()]


def _settings(model: type[BaseModel], prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """Each setting's (type, default, description); a union of sections (the training engines) gives each
    member's settings once, its discriminator with every member's value."""
    settings: dict[str, tuple[str, str, str]] = {}
    for name, field in model.model_fields.items():
        sections = section_types(field.annotation)
        for section in sections:
            for key, (kind, default, description) in _settings(section, f"{prefix}{name}.").items():
                if key in settings and settings[key][0] != kind:
                    settings[key] = (f"{settings[key][0]} / {kind}", *settings[key][1:])
                settings.setdefault(key, (kind, default, description))
        if not sections:
            description = (field.description or "").replace("|", "\\|").replace("\n", " ")
            settings[f"{prefix}{name}"] = (_type_name(field.annotation), _default(field), description)
    return settings


def render() -> str:
    lines = [
        "# Profile reference",
        "",
        "Generated from `profiles/schema.py` by `.venv/bin/python -m grpo_pipeline.profiles.reference > docs/profiles.md`.",
        "Set any of these in a profile file (`--profile-file`, nested YAML) or with `--set KEY=VALUE`;",
        "the layers are: device platform < model recipe (common, then per device) < profile file < `--set`.",
        "",
        f"Built-in model recipes: {', '.join(f'`{m}`' for m in builtin_models())}.",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
        *_rows(RunProfile),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
