"""`Section`: the base of every part of a profile.

Unknown keys are rejected (`extra="forbid"`), so a typo in a profile or a `--set` is an error instead
of a silently ignored setting; assignments are validated too; `true` / `false` is never taken
for a number (pydantic would read `engine.tp=true` as TP 1); infinities and NaN are refused.

The upper bounds below (`le=`) are far above any real model or cluster: they keep the memory
planner's arithmetic finite and the layout search short whatever a profile says.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _is_number(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_number(arg) for arg in get_args(annotation))
    return annotation in (int, float)


class Section(BaseModel):
    # `.inf` / `.nan` are YAML floats: never a size, a memory or a rate (the planner's arithmetic would
    # end in NaN), so no section takes them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("expects a number, not true/false")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def no_nul_in_text(cls, value: Any) -> Any:
        """A NUL ends a C string: no path, command or name the run hands the OS can hold one (a path
        with one fails deep inside os.path, a command line is cut at it)."""
        texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)] \
            if isinstance(value, (list, tuple)) else []
        if any("\0" in text for text in texts):
            raise ValueError("contains a NUL character (\\0), which no path, name or command can hold; remove it")
        return value


def section_types(annotation: Any) -> list[type[BaseModel]]:
    """The sections a field holds: one, or each member of a union (the training engines)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:  # a union's member, tagged
        return section_types(get_args(annotation)[0])
    if get_origin(annotation) not in (None, dict):  # a dict of sections is a value, not a section
        return [section for arg in get_args(annotation) for section in section_types(arg)]
    return []


# Upper bounds of the numbers the planner multiplies (each far above what exists today).
MAX_DEVICES_PER_NODE = 256
MAX_NODES = 16_384
MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_EXPERTS = 4096
MAX_WIDTH = 1 << 20  # hidden, MLP and expert widths
MAX_VOCAB = 1 << 22
MAX_TOKENS = 1 << 24  # one sequence's tokens, a token budget
MAX_SEQUENCES = 1 << 20  # sequences in a batch
MAX_GIB = 1 << 16  # one device's memory
MAX_RATE = 1e6  # TFLOP/s, GB/s
