"""The H200 scripts of issue 32, their parts that need no GPU: bench/verl_carry.py (what travels, a
slimmed wheel, parts that fit a call, chunks joined back on the machine in any order and checked),
bench/verl_real.py (the results of the two runs), bench/bench_vllm_decode.py --check, bench/h200_verl.sh.

    PYTHONPATH=$PWD python -m pytest -q tests/test_verl_carry.py
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import verl_carry  # noqa: E402


def test_the_carry_selects_splits_and_joins():
    assert verl_carry.check_command() == 0


def test_what_the_image_has_or_the_path_never_imports_stays_behind():
    kept = verl_carry.selected({"vllm": "0.24.0", "transformers": "5.9.0", "tokenizers": "0.22.2", "numpy": "2.3.5",
                                "torchvision": "0.26.0", "nvidia-cutlass-dsl": "4.5.2", "flashinfer-python": "0.6.12",
                                "tensordict": "0.10.0", "pytest-asyncio": "1.5.0", "TransferQueue": "0.1.11",
                                "apache-tvm-ffi": "0.1.9"})
    # apache-tvm-ffi: vLLM's engine imports xgrammar, which imports it (the first H200 job's failure)
    assert kept == {"vllm": "0.24.0", "transformers": "5.9.0", "tokenizers": "0.22.2", "tensordict": "0.10.0",
                    "TransferQueue": "0.1.11", "apache-tvm-ffi": "0.1.9"}


def test_a_slimmed_wheel_keeps_modes_and_lists_only_what_it_holds(tmp_path):
    wheel = tmp_path / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name in ("vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
                     "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/x.py",
                     "vllm/third_party/__init__.py", "vllm/third_party/pynvml.py"):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            out.writestr(info, b"x")
        out.writestr("vllm-0.24.0.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in (
            "vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/x.py",
            "vllm/third_party/__init__.py", "vllm/third_party/pynvml.py")))
    verl_carry.slim(wheel, verl_carry.VLLM_DROPPED)
    with zipfile.ZipFile(wheel) as slimmed:
        names = set(slimmed.namelist())
        # vLLM's CUDA detection imports third_party/pynvml.py ("Failed to infer device type" without it)
        assert names == {"vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                         "vllm/third_party/__init__.py", "vllm/third_party/pynvml.py", "vllm-0.24.0.dist-info/RECORD"}
        assert slimmed.getinfo("vllm/_C_stable_libtorch.abi3.so").external_attr >> 16 == 0o755
        record = slimmed.read("vllm-0.24.0.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in record} == names


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal real wheel: its files, a script under .data/scripts (pip puts it in bin/), dist-info."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    members = {**files, f"{name}-1.0.data/scripts/{name}": "#!/bin/sh\necho " + name + "\n",
               f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
               f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as out:
        for member, text in members.items():
            out.writestr(member, text)
        out.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*members, f"{info}/RECORD"]))
    return path


@pytest.mark.e2e  # runs the bench and the command line as subprocesses
def test_parts_installed_one_after_another_add_and_never_replace(tmp_path):
    """Two parts whose wheels share bin/ and a namespace folder: after both, each one's files are there
    (pip --target --upgrade, once per part, had removed `ray` from bin/ on the first H200 run)."""
    site = tmp_path / "site"
    verl_carry.pip_add([_wheel(tmp_path, "first", {"shared_ns/exporter/first.py": "A = 1\n"})], site)
    verl_carry.pip_add([_wheel(tmp_path, "second", {"shared_ns/exporter/second.py": "B = 2\n"})], site)
    assert (site / "bin" / "first").is_file() and (site / "bin" / "second").is_file()
    assert (site / "shared_ns" / "exporter" / "first.py").is_file()
    assert (site / "shared_ns" / "exporter" / "second.py").is_file()
    assert {p.name for p in site.glob("*.dist-info")} == {"first-1.0.dist-info", "second-1.0.dist-info"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")], "the per-part folder is removed"


def test_the_h200_runs_results_are_collected_on_cpu():
    import verl_real

    assert verl_real.check() == 0
    assert verl_real.wilson(0, 10)[0] == 0.0 and verl_real.wilson(10, 10)[1] == 1.0


@pytest.mark.e2e  # runs the bench and the command line as subprocesses
def test_the_vllm_decode_bench_and_the_run_script_check_here(tmp_path):
    """Everything of bench/bench_vllm_decode.py but vLLM; bench/h200_verl.sh parses."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TMPDIR": str(tmp_path)}
    checked = subprocess.run([sys.executable, str(root / "bench" / "bench_vllm_decode.py"), "--check"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert "24 cells to measure from results-h200-decode-floor.json" in checked.stdout
    assert subprocess.run(["bash", "-n", str(root / "bench" / "h200_verl.sh")]).returncode == 0


@pytest.mark.e2e  # runs the verl run's dry run as a subprocess
def test_the_carry_holds_what_the_preflight_checks_the_nodes_for():
    """The carry's resolution is derived from the verl run's own dry run: every distribution the preflight
    asks the node for is in it (math-verify, which the job's reward imports, was missing on the first
    H100 loan), and a pin the preflight would refuse stops the plan before anything is downloaded."""
    import pytest

    needs = verl_carry.job_requirements()
    assert {"verl", "TransferQueue", "math-verify", "vllm", "torch"} <= set(needs)
    carried = {verl_carry.norm(r.split("[")[0].split("=")[0].split(">")[0].split("<")[0])
               for r in verl_carry.requirements(needs)}
    assert {verl_carry.norm(n) for n in needs} - verl_carry.NOT_DISTRIBUTIONS <= carried
    with pytest.raises(SystemExit, match=r"pins verl\[verl-core\]==0.9.1 but the preflight checks the nodes for verl==0.9.2"):
        verl_carry.requirements({"verl": {"version": "==0.9.2"}})


def test_the_carry_plan_needs_uv(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setattr(verl_carry.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="pip install uv"):
        verl_carry.resolve(tmp_path, ["verl==0.9.1"])


@pytest.mark.e2e  # runs bench/h200.sh and the bench as subprocesses
def test_the_step_breakdowns_gpu_command_passes_its_dry_run(tmp_path):
    """bench/h200.sh step as the lease runs it, planned from config-only Qwen3 shapes: the first H100
    loan lost it to a 512-token context after 15 s; here a context too short is refused on the CPU."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DRY": "1",
           "OUT": str(tmp_path), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    planned = subprocess.run(["bash", "bench/h200.sh", "step"], env=env, cwd=root, capture_output=True, text=True,
                             timeout=600)
    assert planned.returncode == 0, planned.stderr[-2000:]
    # Sized for the lent H100 as the flow sizes a step: Qwen3-4B's full training state alone outgrows it (the
    # second H100 loan's out-of-memory error, 100 s in), so it is recorded as not fitting and not run.
    assert "dry run: 4 cells planned" in planned.stdout
    assert "qwen3-1.7b 256+1024 as-is: micro batch" in planned.stdout
    assert "qwen3-4b 256+1024 as-is: does not fit: micro batch 1 needs" in planned.stdout
    # The LoRA table's command: full training and LoRA r16 at Qwen3 0.6B-8B, sized for the H100 the same way.
    lora = subprocess.run(["bash", "bench/h200.sh", "lora"], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert lora.returncode == 0, lora.stderr[-2000:]
    assert "dry run: 6 cells planned" in lora.stdout and "qwen3-8b 256+1024 lora: micro batch" in lora.stdout
    assert "qwen3-8b 256+1024 full: does not fit" in lora.stdout
    refused = subprocess.run([sys.executable, "bench/bench_grpo_step.py", "--device", "gpu", "--model", "qwen3-0.6b",
                              "--completion-length", "9000", "--dry-run"], env=env, cwd=root, capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode != 0 and "max_position_embeddings" in refused.stderr


@pytest.mark.e2e  # runs the bench and the command line as subprocesses
def test_the_gpu_runs_config_passes_the_dry_run_for_both_backends(tmp_path):
    """bench/verl_real.py's config as h200_verl.sh passes it: a config the flow refuses minutes into the
    lease (2,048 arith rows: the first H200 run) is refused here, before any GPU is asked for."""
    import os
    import subprocess

    import verl_real

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    for backend, settings in (("verl", verl_real.COMMON + verl_real.VERL), ("local", verl_real.COMMON),
                              ("verl", verl_real.COMMON + verl_real.VERL + verl_real.FAILURES)):  # kill9, stop
        extra = ["--ray-address", "127.0.0.1:6379"] if backend == "verl" else []
        args = [sys.executable, "-m", "grpo_pipeline", "--model", "smollm2-135m", "--device", "gpu", "--backend", backend,
                "--run-dir", str(tmp_path), *extra, *(a for item in settings for a in ("--set", item)), "--dry-run"]
        planned = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert planned.returncode == 0, planned.stderr[-2000:]
    refused = subprocess.run(args[:-1] + ["--set", "data.arith_train_rows=2048", "--dry-run"], env=env,
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode == 2 and "set data.arith_train_rows <= 674" in refused.stderr
