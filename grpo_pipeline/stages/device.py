"""The `detect_device` stage: decide which kind of device the run uses, and what is there.

    python -m grpo_pipeline --model tiny --device auto --dry-run --json   # the "device" object

An explicit request (`--device`, the flow parameter, or the `DEVICE` env var as in the upstream
launcher) wins; `auto` probes NPU, then CUDA, then falls back to CPU. Probes run in a child
process: on a host where torch_npu is installed but the Ascend toolkit is not sourced, importing it
fails (libhccl.so) and can take `import torch` down with it, which must not kill the pipeline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from grpo_pipeline.errors import DeviceError
from grpo_pipeline.profiles.loader import DEVICE_KINDS, platform_for

if TYPE_CHECKING:
    from grpo_pipeline.generation.plan import GenerationPlan
    from grpo_pipeline.planner.memory import MemoryPlan
    from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.platform import DeviceKind

REQUESTABLE = ("auto", *DEVICE_KINDS)
# `auto` takes the first of these the probe finds usable, else the CPU. The probe itself is where
# libraries (torch_npu, torch.cuda) become device kinds; everything else about a kind is in its
# platform table (profiles/devices/<kind>.yaml).
AUTO_ORDER = ("npu", "gpu")
PROBE_TIMEOUT_S = 120

# Runs in a child interpreter and prints one JSON object. Each probe reports a status:
# absent | toolkit-missing | no-devices | available | error.
_PROBE_SCRIPT = r"""
import json, sys
report = {}
try:
    import torch
except Exception as exc:
    print(json.dumps({"torch": f"torch failed to import: {exc}"}))
    sys.exit(0)

def inventory(module):
    n = module.device_count()
    names, memory = [], []
    for i in range(n):
        props = module.get_device_properties(i)
        names.append(props.name)
        memory.append(round(props.total_memory / 2**30, 1))
    return n, names, memory

try:
    import torch_npu  # noqa: F401
except ModuleNotFoundError:
    report["npu"] = {"status": "absent", "detail": "torch_npu is not installed"}
except ImportError as exc:
    msg = str(exc)
    if ".so" in msg:
        report["npu"] = {"status": "toolkit-missing", "detail":
            f"torch_npu is installed but the Ascend toolkit is not loaded ({msg}); "
            "source /usr/local/Ascend/ascend-toolkit/set_env.sh"}
    else:
        report["npu"] = {"status": "error", "detail": f"import torch_npu failed: {msg}"}
except Exception as exc:
    report["npu"] = {"status": "error", "detail": f"import torch_npu failed: {exc!r}"}
else:
    try:
        n, names, memory = inventory(torch.npu)
        report["npu"] = {"status": "available" if n else "no-devices", "count": n, "names": names,
                         "memory_gib": memory, "detail": f"torch_npu sees {n} NPU(s)"}
    except Exception as exc:
        report["npu"] = {"status": "error", "detail": f"torch_npu loaded but no device answered: {exc}"}

if torch.version.cuda is None:
    report["gpu"] = {"status": "absent", "detail": f"torch {torch.__version__} is a build without CUDA"}
elif not torch.cuda.is_available():
    report["gpu"] = {"status": "no-devices", "detail": "CUDA build, but no driver or no visible GPU"}
else:
    n, names, memory = inventory(torch.cuda)
    report["gpu"] = {"status": "available", "count": n, "names": names, "memory_gib": memory,
                     "cuda_version": torch.version.cuda, "detail": f"CUDA sees {n} GPU(s)"}
print(json.dumps(report))
"""


class DeviceInfo(BaseModel):
    kind: DeviceKind = Field(..., description="Device kind the run uses.")
    count: int = Field(0, description="Devices on this host (0 when not inspected).")
    names: list[str] = Field(default_factory=list, description="Device names.")
    memory_gib: list[float] = Field(default_factory=list, description="Memory per device, GiB.")
    driver_version: str | None = Field(None, description="NVIDIA driver version, when known.")
    cuda_version: str | None = Field(None, description="CUDA version of torch, when known.")
    cann_version: str | None = Field(None, description="Ascend CANN version, when known.")
    decided_by: Literal["requested", "detected"] = Field(..., description="How the kind was chosen.")
    reason: str = Field(..., description="Why this kind, in words.")
    probes: dict[str, str] = Field(default_factory=dict, description="What each probe found.")

    def memory_plan(self, profile: RunProfile) -> MemoryPlan | None:
        """The profile's backend's memory plan, on the devices found here when they are the profile's kind."""
        from grpo_pipeline.backends import backend_for

        return backend_for(profile.backend).memory_plan(profile, *self.found(profile))

    def memory_note(self, profile: RunProfile, generation: GenerationPlan) -> str | None:
        """The profile's backend's word on memory where it has no plan, on the devices found here likewise."""
        from grpo_pipeline.backends import backend_for

        return backend_for(profile.backend).memory_note(profile, generation, *self.found(profile))

    def found(self, profile: RunProfile) -> tuple[list[str] | None, list[float] | None]:
        """(names, GiB) of the devices found here when they are the profile's kind; (None, None) otherwise."""
        here = self.kind == profile.platform.kind and self.count > 0 and bool(self.memory_gib)
        return (self.names, self.memory_gib) if here else (None, None)


def requested_device(cli_value: str | None = None, environ: dict[str, str] | None = None) -> str:
    """An explicit value wins; otherwise `DEVICE` from the environment; otherwise `auto`."""
    environ = os.environ if environ is None else environ
    value = cli_value if cli_value not in (None, "auto") else environ.get("DEVICE", "auto")
    value = value.strip().lower()
    if value not in REQUESTABLE:
        origin = "--device" if cli_value not in (None, "auto") else "DEVICE"
        raise DeviceError(f"unsupported device {origin}={value!r}; use one of {', '.join(REQUESTABLE)}")
    return value


def run_probe(python: str = sys.executable, extra_path: str | None = None) -> dict:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(
            [python, "-c", _PROBE_SCRIPT], capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"torch": f"device probe timed out after {PROBE_TIMEOUT_S}s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"torch": f"device probe crashed (exit {done.returncode}): {done.stderr.strip()[-300:]}"}


def _tool_version(command: list[str] | None) -> str | None:
    if not command or shutil.which(command[0]) is None:
        return None
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out else None


def detect_device(requested: str, dry_run: bool = False, probe: dict | None = None, cluster: str | None = None) -> DeviceInfo:
    """Decide the device kind. A dry run plans for a named kind without requiring it on this host; so
    does a run on a Ray `cluster` (the flow may run on a host without accelerators: the train stage
    checks the cluster's nodes for them before it submits anything)."""
    if requested not in REQUESTABLE:
        raise DeviceError(f"unsupported device {requested!r}; use one of {', '.join(REQUESTABLE)}")
    if dry_run and requested != "auto":
        return DeviceInfo(
            kind=requested,
            decided_by="requested",
            reason=f"requested {requested}; dry run, so not checked on this host",
        )
    if requested == "cpu" and probe is None:
        # The CPU is always there; probing the accelerators (a subprocess that imports torch, ~2 s)
        # would only fill in what this run does not use.
        return DeviceInfo(kind="cpu", count=os.cpu_count() or 1, decided_by="requested",
                          reason="requested cpu (accelerators not probed)")
    report = run_probe() if probe is None else probe
    probes = {kind: info["detail"] for kind, info in report.items() if isinstance(info, dict)}
    if "torch" in report:
        probes["torch"] = report["torch"]
    if requested == "cpu":
        return DeviceInfo(kind="cpu", count=os.cpu_count() or 1, decided_by="requested", reason="requested cpu", probes=probes)
    for kind in AUTO_ORDER if requested == "auto" else (requested,):
        info = report.get(kind) or {}
        if info.get("status") == "available":
            platform = platform_for(kind)
            return DeviceInfo(
                kind=kind,
                count=info["count"],
                names=info["names"],
                memory_gib=info["memory_gib"],
                cuda_version=info.get("cuda_version"),
                driver_version=_tool_version(platform.driver_version_command),
                cann_version=os.environ.get(platform.toolkit_version_var) if platform.toolkit_version_var else None,
                decided_by="requested" if requested != "auto" else "detected",
                reason=info["detail"],
                probes=probes,
            )
        if requested != "auto":
            found = info.get("detail") or report.get("torch") or "no probe result"
            if cluster:
                return DeviceInfo(kind=requested, decided_by="requested", probes=probes,
                                  reason=f"requested {requested} for the Ray cluster at {cluster} (this host: {found})")
            # A torch without the device's support: the fix is another environment, which the platform names.
            fix = platform_for(kind).setup_fix if info.get("status") == "absent" else None
            raise DeviceError(f"--device {requested} is not usable here: {found}" + (f"; {fix}" if fix else ""))
    summary = "; ".join(f"{kind}: {detail}" for kind, detail in probes.items())
    return DeviceInfo(
        kind="cpu", count=os.cpu_count() or 1, decided_by="detected", reason=f"no accelerator found ({summary})", probes=probes
    )
