"""The table of training backends: one row per backend, read by everything that names them.

    python -m grpo_pipeline --model tiny --device cpu --backend local --dry-run   # the choices: the rows' names

Each row says what the flow and the profile need to know about a backend without importing it: its
name, where its class lives (`backends.backend_for` imports it when first asked for), whether it needs
accelerators, whether it plans layouts (`--suggest-layout`, the memory plan) and a one-line
description. The profile's `backend` type, the command line's `--backend` choices, the UI form's
dropdown and `--backend auto` (profiles/loader.py) all read it; each backend's class names its row
(`Backend.name`) and tests/test_backend_table.py holds the class and the row together. The rows sit on
the ground floor, beside the schema, because the schema's types are made from them and the profile
must never import an engine (torchtune's `_recipe_registry.py` keeps its recipes' rows the same way).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BackendCard(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., description="What `--backend` and a profile's `backend` say.")
    home: str = Field(..., description="`module:Class` of the backend (backends/base.py's interface).")
    needs_accelerators: bool = Field(..., description="Runs only on GPUs or NPUs.")
    plans_layouts: bool = Field(..., description="Has a parallel layout to plan: a memory plan, `--suggest-layout`.")
    description: str = Field(..., description="One line: what trains, and where.")


BACKEND_TABLE: dict[str, BackendCard] = {card.name: card for card in (
    BackendCard(name="local", home="grpo_pipeline.backends.local.backend:LocalBackend", needs_accelerators=False, plans_layouts=False,
                description="TRL on Ray Train in the flow's process, on any device"),
    BackendCard(name="verl", home="grpo_pipeline.backends.verl.backend:VerlBackend", needs_accelerators=True, plans_layouts=True,
                description="Megatron + vLLM through verl, as a Ray job on a GPU or NPU cluster"),
)}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKEND_TABLE)
BackendName = Literal[BACKEND_NAMES]  # type: ignore[valid-type]  # the profile's `backend`
BackendChoice = Literal[("auto", *BACKEND_NAMES)]  # type: ignore[valid-type]  # --backend, the form's dropdown


def without_accelerators() -> BackendCard:
    """The backend `auto` gives a recipe whose own backend needs accelerators, on a device without them."""
    return next(card for card in BACKEND_TABLE.values() if not card.needs_accelerators)


def layout_planner() -> BackendCard:
    """The backend whose layouts `--suggest-layout` searches."""
    return next(card for card in BACKEND_TABLE.values() if card.plans_layouts)


def backend_help() -> str:
    """The choices in words, for the command line's and the form's help."""
    rows = ", ".join(f"`{card.name}` ({card.description})" for card in BACKEND_TABLE.values())
    return (f"{rows}; or `auto`: the recipe's backend (`{without_accelerators().name}` on a device without the "
            "accelerators it needs).")
