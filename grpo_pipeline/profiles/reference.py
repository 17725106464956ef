"""Write the profile reference (docs/profiles.md) from the schema's own descriptions.

    .venv/bin/python -m grpo_pipeline.profiles.reference > docs/profiles.md

A test regenerates it and compares, so the reference never drifts from the schema.
"""

from __future__ import annotations

import json
import sys
from typing import Literal, get_args, get_origin

from pydantic import BaseModel

from grpo_pipeline.profiles.loader import section_type, builtin_models
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
    rows = []
    for name, field in model.model_fields.items():
        section = section_type(field.annotation)
        if section is not None:
            rows += _rows(section, f"{prefix}{name}.")
            continue
        kind = _type_name(field.annotation)
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {kind} | {_default(field)} | {description} |")
    return rows


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
