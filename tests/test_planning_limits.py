"""What planning refuses in one line (exit 2) before it would crash, hang or search without end:
numbers the memory planner multiplies (infinite, huge), an accelerator without a row, profile files
that never end, a custom reward that training could not load."""

from __future__ import annotations

import os

import pytest

QWEN = ("--model", "qwen3.5-122b-a10b", "--device", "gpu")


def one_error_line(done) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (done.returncode, lines)
    assert "Traceback" not in done.stdout + done.stderr
    return lines[0]


@pytest.mark.parametrize(("setting", "fragment"), [
    ("platform.device_memory_gib=.inf", "platform.device_memory_gib=inf: input should be a finite number"),
    ("platform.device_memory_gib=1e308", "platform.device_memory_gib='1e308': input should be less than or equal to 65536"),
    ("platform.accelerators.H20.memory_gib=.inf", "platform.accelerators.H20.memory_gib=inf: input should be a finite number"),
    ("platform.accelerators.H20.bf16_tflops=.nan", "platform.accelerators.H20.bf16_tflops=nan: input should be a finite number"),
    ("platform.accelerator=X100", "platform.accelerator 'X100' has no row in platform.accelerators (known: H20, H100"),
    ("cluster.devices_per_node=1000000000", "cluster.devices_per_node=1000000000: input should be less than or equal to 256"),
    ("model.architecture.num_experts=1000000000", "model.architecture.num_experts=1000000000: input should be less"),
    ("model.architecture.num_layers=1000000000", "model.architecture.num_layers=1000000000: input should be less"),
    ("data.max_response_length=1000000000000", "data.max_response_length=1000000000000: input should be less"),
])
@pytest.mark.parametrize("mode", ["--dry-run", "--suggest-layout"])
def test_numbers_the_planner_multiplies_are_bounded_and_finite(cli, setting, fragment, mode):
    assert fragment in one_error_line(cli(*QWEN, mode, "--set", setting))


def test_the_layout_search_at_every_bound_at_once_ends(cli):
    """The largest cluster and model the bounds admit: the search ends (seconds, not minutes) with an answer."""
    done = cli(*QWEN, "--suggest-layout", "--set", "cluster.devices_per_node=256", "--set", "cluster.nnodes=16384",
               "--set", "model.architecture.num_layers=1008", "--set", "model.architecture.num_experts=4032")
    assert done.returncode in (0, 2) and "valid layouts fit" in done.stdout


@pytest.mark.parametrize("device_file", ["/dev/zero", "/dev/urandom"])
def test_a_profile_file_that_never_ends_is_refused_without_reading_it(cli, device_file):
    line = one_error_line(cli("--model", "tiny", "--device", "cpu", "--profile-file", device_file, "--dry-run"))
    assert line == f"error: profile file {device_file} is not a regular file (a device or a pipe); give the path of a YAML file"


def test_a_profile_file_that_is_a_pipe_is_refused_without_opening_it(cli, tmp_path):
    fifo = tmp_path / "profile.yaml"
    os.mkfifo(fifo)  # opening it to read would block until a writer comes
    assert "is not a regular file" in one_error_line(cli("--model", "tiny", "--device", "cpu", "--profile-file",
                                                         str(fifo), "--dry-run"))


def test_a_custom_reward_training_could_not_load_is_refused_when_the_run_is_planned(cli, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("import math\n\ndef exact(response, ground_truth):\n    return float(response == ground_truth)\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def exact(response, ground_truth:\n")
    planned = ("--model", "tiny", "--device", "cpu", "--dry-run", "--set")
    cases = {
        f"{tmp_path}/missing.py:exact": "missing.py is not a file; give the path of a Python file",
        f"{reward}:score": f"{reward} defines no 'score' at its top level",
        f"{broken}:exact": f"{broken} line 1 is not valid Python",
        f"{reward}:not-a-name": "expected /path/to/file.py:function",
    }
    for spec, fragment in cases.items():
        assert fragment in one_error_line(cli(*planned, f"algorithm.reward_function={spec}")), spec
    for name in ("exact", "math"):  # a function it defines, or any top-level name (imported, assigned)
        assert cli(*planned, f"algorithm.reward_function={reward}:{name}").returncode == 0
