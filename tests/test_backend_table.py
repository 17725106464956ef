"""The table of backends (profiles/backend_table.py) is the one list: each row's class is the backend
of that name and behaves as its row says, and the profile's type, the command line, the form and
`--backend auto` offer and decide from exactly its rows."""

from __future__ import annotations

from importlib import import_module
from typing import get_args

import pytest

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import Backend
from grpo_pipeline.profiles.backend_table import BACKEND_NAMES, BACKEND_TABLE, BackendCard, layout_planner, without_accelerators
from grpo_pipeline.profiles.loader import choose_backend, resolve_run_profile


@pytest.mark.parametrize("card", BACKEND_TABLE.values(), ids=BACKEND_NAMES)
def test_each_row_is_its_class_and_says_what_the_class_does(card):
    module, _, name = card.home.partition(":")
    cls = getattr(import_module(module), name)
    backend = backend_for(card.name)
    assert type(backend) is cls and backend.name == card.name and backend.card is card
    # plans layouts: the class has a memory plan of its own (what the dry run and --suggest-layout show)
    assert (cls.memory_plan is not Backend.memory_plan) == card.plans_layouts
    # needs accelerators: the class refuses a CPU profile for that reason, and only then
    cpu = resolve_run_profile("tiny", "cpu", card.name, validate=False)[0]
    refusals = " ".join(backend.profile_problems(cpu))
    assert ("needs GPUs or NPUs" in refusals) == card.needs_accelerators
    assert card.description and "\n" not in card.description


def test_the_profile_the_command_line_and_the_form_offer_the_tables_names():
    from prefect.utilities.callables import parameter_schema

    from grpo_pipeline.flows.form import run_from_form
    from grpo_pipeline.flows.grpo import build_parser
    from grpo_pipeline.run.request import RunRequest
    from grpo_pipeline.profiles.schema import RunProfile

    assert RunProfile.model_json_schema()["properties"]["backend"]["enum"] == list(BACKEND_NAMES)
    assert get_args(RunRequest.model_fields["backend"].annotation) == ("auto", *BACKEND_NAMES)
    assert parameter_schema(run_from_form).model_dump()["properties"]["backend"]["enum"] == ["auto", *BACKEND_NAMES]
    help_text = next(a.help for a in build_parser()._actions if "--backend" in a.option_strings)
    assert help_text.startswith(" | ".join(["auto", *BACKEND_NAMES])) and all(
        card.description in help_text for card in BACKEND_TABLE.values())


def test_backend_auto_decides_from_the_rows_not_a_name(monkeypatch):
    """A recipe whose backend needs accelerators gets the table's backend without them on a CPU,
    whatever that backend is called."""
    monkeypatch.setitem(BACKEND_TABLE, "gpu-only", BackendCard(
        name="gpu-only", home="grpo_pipeline.backends.verl.backend:VerlBackend", needs_accelerators=True, plans_layouts=True,
        description="a stand-in row"))
    recipe = [("device profile cpu", {}), ("model recipe big (common)", {"backend": "gpu-only"})]
    assert choose_backend(recipe, "auto", "cpu") == (without_accelerators().name, (
        "model recipe big trains with gpu-only, which needs GPUs or NPUs: on device cpu the local backend trains it"))
    assert choose_backend(recipe, "auto", "gpu") == ("gpu-only", "model recipe big trains with the gpu-only backend "
                                                     "(a stand-in row), and device gpu has accelerators")
    assert layout_planner().name == "verl"  # the first row that plans layouts
