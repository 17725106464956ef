"""Device detection: the real probe (a child interpreter) on whatever host runs the tests, and the
decision from the probe's answer, given explicitly so no test assumes the host has no GPU or NPU."""

from __future__ import annotations

import pytest

from probes import NO_ACCELERATOR
from grpo_pipeline.errors import DeviceError
from grpo_pipeline.stages.device import detect_device, requested_device, run_probe

STATUSES = {"absent", "toolkit-missing", "no-devices", "available", "error"}


@pytest.mark.e2e  # runs the device probe in a subprocess
def test_the_real_probe_answers_for_every_kind_on_this_host():
    report = run_probe()
    assert set(report) == {"npu", "gpu"} and all(report[kind]["status"] in STATUSES for kind in report), report
    for kind, answer in report.items():
        assert answer["detail"]
        if answer["status"] == "available":  # a GPU or NPU host: it says how many and which
            assert answer["count"] > 0 and len(answer["names"]) == answer["count"] == len(answer["memory_gib"])
    decided = detect_device("auto", probe=report)
    assert decided.kind == next((k for k in ("npu", "gpu") if report[k]["status"] == "available"), "cpu")


@pytest.mark.e2e  # runs the device probe in a subprocess
def test_probe_tells_toolkit_missing_from_absent(tmp_path):
    # A real torch_npu stand-in (first on the path) that fails the way it does without a sourced CANN toolkit.
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")\n'
    )
    report = run_probe(extra_path=str(tmp_path))
    assert report["npu"]["status"] == "toolkit-missing"
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in report["npu"]["detail"]
    with pytest.raises(DeviceError, match="npu is not usable here: torch_npu is installed but the Ascend toolkit"):
        detect_device("npu", probe=report)
    assert detect_device("auto", probe=report).kind != "npu"  # falls through to a GPU, or the CPU
    # A run on a Ray cluster may be planned from a host without NPUs: the cluster's nodes are checked.
    on_cluster = detect_device("npu", probe=report, cluster="head:6379")
    assert (on_cluster.kind, on_cluster.count, on_cluster.decided_by) == ("npu", 0, "requested")
    assert on_cluster.reason.startswith("requested npu for the Ray cluster at head:6379 (this host: torch_npu is installed")


@pytest.mark.e2e  # runs the device probe in a subprocess
def test_probe_reports_other_import_failures(tmp_path):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("cannot import name npu_ops")\n')
    assert run_probe(extra_path=str(tmp_path))["npu"]["status"] == "error"


def test_auto_falls_back_to_cpu_with_a_reason():
    info = detect_device("auto", probe=NO_ACCELERATOR)
    assert info.kind == "cpu" and info.decided_by == "detected"
    assert "no accelerator found" in info.reason and "torch_npu is not installed" in info.reason


@pytest.mark.parametrize("kind", ["gpu", "npu"])
def test_explicit_unusable_device_is_an_error_not_a_fallback(kind):
    with pytest.raises(DeviceError, match=f"--device {kind} is not usable here"):
        detect_device(kind, probe=NO_ACCELERATOR)


def test_dry_run_plans_for_the_requested_kind_without_probing():
    info = detect_device("npu", dry_run=True, probe={})
    assert info.kind == "npu" and info.decided_by == "requested" and "not checked" in info.reason


def test_detection_picks_an_available_accelerator():
    report = {"npu": {"status": "absent", "detail": "torch_npu is not installed"},
              "gpu": {"status": "available", "count": 2, "names": ["H200", "H200"], "memory_gib": [139.8, 139.8],
                      "cuda_version": "12.8", "detail": "CUDA sees 2 GPU(s)"}}
    info = detect_device("auto", probe=report)
    assert (info.kind, info.count, info.decided_by, info.cuda_version) == ("gpu", 2, "detected", "12.8")


def test_requested_device_precedence():
    assert requested_device("npu", {"DEVICE": "gpu"}) == "npu"
    assert requested_device("auto", {"DEVICE": "GPU"}) == "gpu"
    assert requested_device(None, {}) == "auto"
    with pytest.raises(DeviceError, match="unsupported device DEVICE='tpu'"):
        requested_device("auto", {"DEVICE": "tpu"})
