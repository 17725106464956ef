"""Training engines behind one interface (backends/base.py), found by name.

    python -m flows.grpo --model tiny --device cpu --backend local          # TRL on Ray Train
    python -m flows.grpo --model qwen3.5-122b-a10b --device npu --dry-run   # verl: Megatron + vLLM

`local` (backends/local/) and `verl` (backends/verl/). Each is imported when first asked for, so
planning a run never imports an engine it does not use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.base import Backend

BACKENDS = {"local": "backends.local.backend:LocalBackend", "verl": "backends.verl.backend:VerlBackend"}
_made: dict[str, Backend] = {}


def backend_for(name: str) -> Backend:
    """The backend of that name (`profile.backend`, `TrainResult.backend`)."""
    if name not in _made:
        module, _, cls = BACKENDS[name].partition(":")
        _made[name] = getattr(import_module(module), cls)()
    return _made[name]
