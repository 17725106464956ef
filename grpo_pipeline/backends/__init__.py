"""Training engines behind one interface (backends/base.py), found by name.

    python -m grpo_pipeline --model tiny --device cpu --backend local          # TRL on Ray Train
    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run   # verl: Megatron + vLLM

Which backends there are, and what each needs, is profiles/backend_table.py (one row each; its
`home` is the class here). Each is imported when first asked for, so planning a run never imports an
engine it does not use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from grpo_pipeline.profiles.backend_table import BACKEND_TABLE

if TYPE_CHECKING:
    from grpo_pipeline.backends.base import Backend

_made: dict[str, Backend] = {}


def backend_for(name: str) -> Backend:
    """The backend of that name (`profile.backend`, `TrainResult.backend`)."""
    if name not in _made:
        module, _, cls = BACKEND_TABLE[name].home.partition(":")
        _made[name] = getattr(import_module(module), cls)()
    return _made[name]
