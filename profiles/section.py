"""`Section`: the base of every part of a profile.

Unknown keys are rejected (`extra="forbid"`), so a typo in a profile or a `--set` is an error instead
of a silently ignored setting; assignments are validated too; and `true` / `false` is never taken
for a number (pydantic would read `engine.tp=true` as TP 1).
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _is_number(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_number(arg) for arg in get_args(annotation))
    return annotation in (int, float)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("expects a number, not true/false")
        return value
