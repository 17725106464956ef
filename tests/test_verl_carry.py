"""The H200 scripts of issue 32, their parts that need no GPU: bench/verl_carry.py (what travels, a
slimmed wheel, parts that fit a call, chunks joined back on the machine in any order and checked),
bench/verl_real.py (the results of the two runs), bench/bench_vllm_decode.py --check, bench/h200_verl.sh.

    PYTHONPATH=$PWD python -m pytest -q tests/test_verl_carry.py
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import verl_carry  # noqa: E402


def test_the_carry_selects_splits_and_joins():
    assert verl_carry.check_command() == 0


def test_what_the_image_has_or_the_path_never_imports_stays_behind():
    kept = verl_carry.selected({"vllm": "0.24.0", "transformers": "5.9.0", "tokenizers": "0.22.2", "numpy": "2.3.5",
                                "torchvision": "0.26.0", "nvidia-cutlass-dsl": "4.5.2", "flashinfer-python": "0.6.12",
                                "tensordict": "0.10.0", "pytest-asyncio": "1.5.0", "TransferQueue": "0.1.11"})
    assert kept == {"vllm": "0.24.0", "transformers": "5.9.0", "tokenizers": "0.22.2", "tensordict": "0.10.0",
                    "TransferQueue": "0.1.11"}


def test_a_slimmed_wheel_keeps_modes_and_lists_only_what_it_holds(tmp_path):
    wheel = tmp_path / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name in ("vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
                     "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/x.py"):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            out.writestr(info, b"x")
        out.writestr("vllm-0.24.0.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in (
            "vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/x.py")))
    verl_carry.slim(wheel, verl_carry.VLLM_DROPPED)
    with zipfile.ZipFile(wheel) as slimmed:
        names = set(slimmed.namelist())
        assert names == {"vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                         "vllm-0.24.0.dist-info/RECORD"}
        assert slimmed.getinfo("vllm/_C_stable_libtorch.abi3.so").external_attr >> 16 == 0o755
        record = slimmed.read("vllm-0.24.0.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in record} == names


def test_the_h200_runs_results_are_collected_on_cpu():
    import verl_real

    assert verl_real.check() == 0
    assert verl_real.wilson(0, 10)[0] == 0.0 and verl_real.wilson(10, 10)[1] == 1.0


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
