"""What each node's image can run, asked of every node before a cluster job is submitted.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379   # the preflight

One small Ray task per alive node, pinned to it, holding nothing (no CPU, no device: a job may run
beside it), in the run's runtime env, so it sees what the job's workers will see. It answers in two
tiers: what the files say (versions from package metadata, torch's build from torch/version.py,
NVML's driver and device count, the CANN version file, /dev/davinci*), in well under a second; then,
for the packages a requirement asks to import or whose registry must know the model, a child
process that imports them (seconds; a native library that crashes or hangs takes the child down,
not the task, and is reported). Nothing here imports torch or initialises a device.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from grpo_pipeline.profiles.requirements import COULD_NOT_START, NodeFacts, NodeRequirement

# Always reported, whatever the profile asks: the stack a person needs to see to tell two images apart.
STACK = ("torch", "torch-npu", "transformers", "ray", "verl", "megatron-core", "mbridge", "megatron-bridge",
         "transformer-engine", "flash-linear-attention", "vllm", "vllm-ascend")


def _version(name: str) -> str | None:
    try:
        return metadata.distribution(name).version
    except metadata.PackageNotFoundError:
        return None


def _torch_build() -> str | None:
    """cuda/rocm/cpu from torch/version.py, read, not imported (importing torch takes seconds)."""
    try:
        text = Path(metadata.distribution("torch").locate_file("torch/version.py")).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        key = key.split(":")[0].strip()
        if key in ("cuda", "hip"):
            fields[key] = value.strip().strip("'\"")
    if fields.get("cuda") not in (None, "None"):
        return f"cuda {fields['cuda']}"
    if fields.get("hip") not in (None, "None"):
        return f"rocm {fields['hip']}"
    return "cpu"


def _nvidia() -> tuple[str | None, int]:
    """The driver's version and the node's GPUs, from NVML (no CUDA context, all GPUs of the node)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, 0
    if nvml.nvmlInit_v2() != 0:
        return None, 0
    try:
        count, version = ctypes.c_uint(0), ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        driver = version.value.decode() if nvml.nvmlSystemGetDriverVersion(version, 96) == 0 else None
        return driver, count.value
    finally:
        nvml.nvmlShutdown()


def _cann_version() -> str | None:
    """The Ascend toolkit's version from its install file (the layouts of CANN <= 8.3 and 8.5)."""
    homes = [os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")]
    homes += ["/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann"]
    for home in filter(None, homes):
        for info in glob.glob(os.path.join(home, "*-linux", "ascend_toolkit_install.info")):
            for line in Path(info).read_text(errors="replace").splitlines():
                if line.startswith("version="):
                    return line.split("=", 1)[1].strip()
    return None


def _installed(name: str, need: NodeRequirement | None, unreadable: dict[str, str]) -> tuple[str | None, str]:
    """The version `name` is installed at, and under which name; a distribution whose metadata cannot
    be read (not UTF-8, cut short) is put in `unreadable` with why, not raised: that is this node's answer."""
    for dist in (name, *(need.also_named if need else ())):
        try:
            found = _version(dist)
        except Exception as exc:  # whatever a damaged METADATA raises while importlib reads it
            unreadable[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            return None, dist
        if found is not None:
            return found, dist
    return None, name


def look(requirements: dict[str, dict | None], timeout_s: float) -> dict:
    """On a node: the facts the requirements ask about (NodeFacts, as a dict without the node's name)."""
    needs = {name: NodeRequirement.model_validate(spec) for name, spec in requirements.items() if spec is not None}
    driver, gpus = _nvidia()
    versions: dict[str, str | None] = {"python": platform.python_version(), "cann": _cann_version(),
                                       "nvidia-driver": driver}
    installed_as: dict[str, str] = {}
    unreadable: dict[str, str] = {}
    for name in (*STACK, *needs):
        if name not in versions:
            versions[name], found_as = _installed(name, needs.get(name), unreadable)
            if found_as != name:
                installed_as[name] = found_as
    npus = len(glob.glob("/dev/davinci[0-9]*"))
    deep = {"imports": sorted({m for n, need in needs.items() if versions.get(n) for m in need.imports}),
            "registries": sorted({need.registry for n, need in needs.items() if versions.get(n) and need.registry})}
    # The child gets most of the node's time: a hung import is then named, not a silent node.
    answers = {"imports": {}, "registries": {}}
    if deep["imports"] or deep["registries"]:
        answers = _import_in_child(deep, 0.8 * timeout_s)
    return {"versions": versions, "installed_as": installed_as, "unreadable": unreadable, "torch_build": _torch_build(),
            "devices": max(gpus, npus), **answers}


# The child: import each module or read each registry it is given, a marked JSON line before and after
# each (a module may print too, without a final newline: each mark starts a line of its own, and is
# found wherever it is in one); what a crash leaves unanswered is the step it died in.
_MARK = "@grpo-preflight@ "
_CHILD = r"""
import importlib, json, sys
MARK = "@grpo-preflight@ "
for kind, name in json.loads(sys.argv[1]):
    print("\n" + MARK + json.dumps([kind, name, None]), flush=True)
    try:
        module, _, attribute = name.partition(":")
        found = importlib.import_module(module)
        for part in filter(None, attribute.split(".")):
            found = getattr(found, part)
        answer = "ok" if kind == "import" else sorted(map(str, found() if callable(found) else found))
    except BaseException as exc:
        answer = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print("\n" + MARK + json.dumps([kind, name, answer]), flush=True)
"""


def _import_in_child(asked: dict, timeout_s: float) -> dict:
    """Import the modules and read the registries in child processes, within `timeout_s` in all: an
    import that crashes its process is named, and a fresh child goes on with the rest."""
    answers: dict[str, dict] = {"imports": {}, "registries": {}}
    todo = [["import", module] for module in asked["imports"]] + [["registry", r] for r in asked["registries"]]
    deadline = time.monotonic() + timeout_s
    while todo:
        try:
            # From "/": a Ray worker's own working directory can be gone (a raylet started in a folder that was
            # replaced since), and the child must not blame the packages for that.
            done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(todo)], capture_output=True, text=True,
                                  errors="replace", timeout=max(0.1, deadline - time.monotonic()), cwd="/")
            output, ended, more = done.stdout, f"the importing process ended with exit code {done.returncode}", True
            if _MARK not in output:  # it never began: no module was tried, so none is blamed
                said = [line for line in done.stderr.splitlines() if line.strip()]
                ended = f"{COULD_NOT_START} (exit code {done.returncode}: {said[-1].strip() if said else 'nothing on stderr'})"
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            ended, more = f"the import did not finish in {timeout_s:.0f} s", False
        except OSError as exc:  # the interpreter itself could not be started
            output, ended = "", f"{COULD_NOT_START} ({sys.executable}: {exc.strerror or exc})"
        started = None
        for line in output.splitlines():
            if _MARK not in line:
                continue
            kind, name, answer = json.loads(line.partition(_MARK)[2])
            started = [kind, name] if answer is None else None
            if answer is not None:
                answers["imports" if kind == "import" else "registries"][name] = None if answer == "ok" else answer
                todo.remove([kind, name])
        if started is None:  # it died before it began the next one (or the child itself failed)
            more = False
        for kind, name in list(todo):
            if [kind, name] == started or not more:
                answers["imports" if kind == "import" else "registries"][name] = (
                    ended if [kind, name] == started or ended.startswith(COULD_NOT_START) else f"not reached: {ended}")
                todo.remove([kind, name])
    return answers
