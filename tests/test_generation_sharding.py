"""A cluster node generates with the engine of the run's plan (generation/plan.py decided it once), never
with whatever its image happens to have importable."""

from __future__ import annotations

import importlib.machinery
import socket
import sys
import types
from pathlib import Path

import pytest

from grpo_pipeline.generation import sharding
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import GenerationSettings, Response

PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}]]


@pytest.fixture
def engines(monkeypatch) -> list[str]:
    """The two engines, standing in: each records that it ran."""
    ran: list[str] = []
    for name in ("transformers", "vllm"):
        monkeypatch.setattr(sharding, f"{name}_generate",
                            lambda model_dir, prompts, settings, name=name: ran.append(name) or [[Response(
                                text="7", tokens=1, truncated=False)]])
    monkeypatch.setattr(sharding, "_node_torch_device", lambda wanted: wanted)
    return ran


def importable_vllm(monkeypatch) -> None:
    """A node whose image has vLLM: `import vllm` and find_spec find it."""
    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", fake)


def absent_vllm(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, find_spec says so


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_the_plans_engine_runs_whether_or_not_the_node_has_vllm(engines, monkeypatch, engine):
    settings = GenerationSettings(plan=GenerationPlan(engine=engine, decoder=None if engine == "vllm" else "generate"))
    importable_vllm(monkeypatch)
    with_vllm, _ = sharding.generate_on_node(Path("/m"), PROMPTS, settings)
    if engine == "transformers":
        absent_vllm(monkeypatch)
        without_vllm, _ = sharding.generate_on_node(Path("/m"), PROMPTS, settings)
        assert without_vllm == with_vllm == f"transformers (cpu) on {socket.gethostname()}"
        assert engines == ["transformers", "transformers"]
    else:
        assert with_vllm == f"vllm on {socket.gethostname()}" and engines == ["vllm"]


def test_a_plan_for_vllm_on_a_node_without_it_names_the_node(engines, monkeypatch):
    absent_vllm(monkeypatch)
    settings = GenerationSettings(plan=GenerationPlan(engine="vllm", decoder=None))
    with pytest.raises(RuntimeError, match=f"^{socket.gethostname()}: the run's plan generates with vLLM, which this "
                                           "node's image lacks; install vllm"):
        sharding.generate_on_node(Path("/m"), PROMPTS, settings)
    assert engines == []
