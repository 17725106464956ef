"""What the docs tell a person to run, run as written: every command line of a bash block in README.md and
the pages it links (docs/**/*.md) has a check here, and a line no check covers fails the suite.

- planning commands (`--dry-run`, `--suggest-layout`) run as written and exit 0 (a pipe: through bash);
- a run's command is planned as written (its `--dry-run`), and the tiny CPU runs of the docs run whole
  (tests/e2e/test_docs_runs.py);
- a command with a placeholder (`<head>`, `/path/to/...`) parses: its options are the program's;
- make targets exist (`make -n`), `make setup-gpu DRY=1` prints its plan or refuses a host without a GPU;
- the venv's own tools (`.venv/bin/prefect`, `mlflow`, `tensorboard`, `wandb`) have the subcommand;
  an extra named in `pip install -e '.[x]'` is pyproject's; a bench script reading a stored result runs,
  a measuring one shows its options in `--help`;
- lines for the lent GPU machine (`bash bench/h200.sh <what>`, `python3 bench/...`) name a script and a case
  that exist;
- the project's tools (`.venv/bin/python tools/...`) as bench scripts: one with options shows them in `--help`
  (a tool that runs the pipeline takes minutes), one without runs as written;
- a reference harness in a venv of its own (`python3 -m venv /tmp/x`, `/tmp/x/bin/python tools/...`): the
  scripts it names exist and what it installs is pinned (the install itself is the harness's, not this host's).

Also: the sample profile file of docs/configuration.md loads, and the dry run's resolved profile loads back
as a profile file and plans the same run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def bash_lines(path: Path) -> list[str]:
    """The command lines of the file's ```bash blocks (continuations joined)."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return lines


def planning_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for line in bash_lines(path):
            command = line.split(" #")[0].split(" | ")[0].strip()
            words = shlex.split(command) if "grpo_pipeline" in command else []
            if not words or not {"--dry-run", "--suggest-layout"} & set(words) or "<" in command:
                continue
            found.append((f"{path.name}: {command}", words[words.index("grpo_pipeline") + 1:]))
    return found


COMMANDS = planning_commands()


def test_the_docs_show_planning_commands_for_every_device():
    devices = {words[words.index("--device") + 1] for _, words in COMMANDS if "--device" in words}
    assert {"cpu", "gpu", "npu"} <= devices and len(COMMANDS) >= 10


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[name for name, _ in COMMANDS])
def test_each_documented_planning_command_runs(cli, args):
    done = cli(*args)
    assert done.returncode == 0, done.stderr


def sample_profile() -> str:
    text = (ROOT / "docs" / "configuration.md").read_text()
    (block,) = re.findall(r"```yaml\n(# my-run\.yaml.*?)```", text, re.S)
    return block


def test_the_sample_profile_file_loads_and_plans(cli, tmp_path):
    sample = tmp_path / "my-run.yaml"
    sample.write_text(sample_profile())
    done = cli("--model", "smollm2-135m", "--device", "cpu", "--profile-file", str(sample), "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["profile"]["trainer"]["total_training_steps"] == 30 and plan["profile"]["cluster"]["devices_per_node"] == 2
    assert plan["generation"]["decoder"] == "native" and plan["profile"]["eval"]["samples_per_prompt"] == 4


@pytest.mark.parametrize(("model", "device"), [("smollm2-135m", "cpu"), ("qwen3.5-122b-a10b", "npu")])
def test_the_dry_runs_resolved_profile_loads_back_as_a_profile_file(cli, tmp_path, model, device):
    first = cli("--model", model, "--device", device, "--dry-run", "--json", "--set", "trainer.total_training_steps=7")
    assert first.returncode == 0, first.stderr
    resolved = json.loads(first.stdout)
    saved = tmp_path / "resolved.yaml"
    saved.write_text(yaml.safe_dump(resolved["profile"], sort_keys=False))
    again = cli("--model", model, "--device", device, "--profile-file", str(saved), "--dry-run", "--json")
    assert again.returncode == 0, again.stderr
    replanned = json.loads(again.stdout)
    assert replanned["profile"] == resolved["profile"] and replanned["command"][:3] == resolved["command"][:3]


def test_the_dry_run_json_keys_the_docs_list_are_the_dry_runs(cli):
    (line,) = [line for line in bash_lines(ROOT / "docs" / "running.md") if "--json   # {" in line]
    listed = json.loads("[" + line.split("# {", 1)[1].rstrip("}") + "]")
    done = cli(*shlex.split(line.split(" #")[0])[3:])
    assert done.returncode == 0, done.stderr
    assert listed == list(json.loads(done.stdout))


def test_the_readme_sets_up_deployments_as_docs_deployments_md_does():
    """Every work queue a cluster's deployments share (prefect.yaml, those whose runs reach a Ray
    cluster) is created with a limit of one run in both, and the pool, queue and worker lines agree."""
    def setup(path: Path) -> list[str]:
        return [line.split(" #")[0].strip() for line in bash_lines(path)
                if re.match(r"\.venv/bin/prefect (work-pool|work-queue|worker) ", line)]

    readme, deployments = setup(ROOT / "README.md"), setup(ROOT / "docs" / "deployments.md")
    assert readme == deployments
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    cluster_queues = {d["work_pool"]["work_queue_name"] for d in spec["deployments"]
                      if "RAY_ADDRESS" in d["work_pool"].get("job_variables", {}).get("env", {})}
    assert cluster_queues and all(
        f".venv/bin/prefect work-queue create {queue} --pool grpo-process --limit 1" in readme for queue in cluster_queues)


def test_the_verl_keys_docs_local_backend_md_names_are_verls_own():
    """Each key of the table's verl column is a key of the config verl's `main_ppo` composes (the
    rendered overrides of a recipe), written in full, so none reads like a profile setting."""
    from test_verl_compose import render
    from verl_config import compose_verl, flatten

    text = (ROOT / "docs" / "local-backend.md").read_text()
    table = text.split("| profile key | verl's own key", 1)[1].split("\n\n", 1)[0]
    keys = {key.split("=")[0] for row in table.splitlines()[2:]
            for key in re.findall(r"`([a-z_]+\.[a-z_.]+(?:=[a-z]+)?)`", row.split("|")[2])}
    composed = flatten(compose_verl(render("qwen3.5-35b-a3b", "gpu")[3]))
    assert len(keys) >= 20 and sorted(k for k in keys if k not in composed) == []


# --- every command line, as written ------------------------------------------------------------------

PLACEHOLDER = re.compile(r"<[a-z][^>]*>|/path/|/models/|/shared/")
VENV_TOOLS = {"prefect", "mlflow", "tensorboard", "wandb", "pip"}


def every_command() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}: {line}", line) for path in DOCS for line in bash_lines(path)
            if line and not line.startswith("#")]


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 program args` -> ({A: 1, B: 2}, [program, args])."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def kind_of(line: str) -> str:
    command = line.split(" #")[0].strip()
    env, words = split_env(shlex.split(command.replace(" | ", " PIPE ")))
    program = words[0] if words else ""
    if program == "export":
        return "export"
    if program == "make":
        return "make"
    if program in ("python3", "bash") and any(w.startswith("bench/") for w in words):
        return "gpu-machine"
    if program == ".venv/bin/python" and len(words) > 1 and words[1].startswith(("bench/", "tools/")):
        return "bench"
    if program == ".venv/bin/python" and words[1:3] == ["-m", "grpo_pipeline"]:
        if PLACEHOLDER.search(command):
            return "cli-template"
        if "PIPE" in words:
            return "cli-pipe"
        return "cli-plan" if {"--dry-run", "--suggest-layout"} & set(words) else "cli-run"
    if program == ".venv/bin/python" and len(words) > 2 and words[1] == "-m" and words[2].startswith("grpo_pipeline."):
        return "module"
    if program.startswith(".venv/bin/") and program.removeprefix(".venv/bin/") in VENV_TOOLS:
        return "venv-tool"
    if words[:3] == ["python3", "-m", "venv"] or re.fullmatch(r"/tmp/[^/]+/bin/python", program):
        return "own-venv"
    return "unknown"


COMMAND_LINES = every_command()


def test_every_documented_command_has_a_check():
    unknown = [name for name, line in COMMAND_LINES if kind_of(line) == "unknown"]
    assert unknown == [], "documented commands no check covers (write them with .venv/bin/python or make)"
    assert len(COMMAND_LINES) >= 60


@pytest.mark.e2e  # runs each documented command as a subprocess
@pytest.mark.parametrize("line", [line for _, line in COMMAND_LINES], ids=[name for name, _ in COMMAND_LINES])
def test_each_documented_command_runs_as_written_or_as_far_as_this_host_allows(cli, line, tmp_path):
    command = line.split(" #")[0].strip()
    kind = kind_of(line)
    env, words = split_env(shlex.split(command.replace(" | ", " PIPE ")))
    if kind == "export":
        assert re.fullmatch(r"export [A-Z_][A-Z0-9_]*=\S+", command), command
    elif kind == "make":
        targets = [w for w in words[1:] if "=" not in w]
        done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and targets, (command, done.stderr)
    elif kind == "gpu-machine":
        script = next(w for w in words if w.startswith("bench/"))
        assert (ROOT / script).is_file(), script
        if script == "bench/h200.sh":
            case = words[words.index(script) + 1]
            assert f"\n  {case})" in (ROOT / script).read_text(), f"bench/h200.sh has no case {case!r}"
    elif kind == "bench":
        # A stored result's table (or a tool without options) runs as written; a measurement or a whole run
        # (minutes, bench/'s business, never a pass/fail test's) only shows that its options are the script's.
        measures = "bench/results-" not in command and "argparse" in (ROOT / words[1]).read_text()
        run = [*words[:2], "--help"] if measures else words
        done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        assert done.returncode == 0 and done.stdout.strip(), (command, done.stderr[-2000:])
        if run is not words:
            options = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
            assert all(option in done.stdout for option in options), (options, done.stdout)
    elif kind == "cli-plan":
        done = cli(*words[3:], env=env)
        assert done.returncode == 0, done.stderr
    elif kind == "cli-run":  # planned as it would run (a GPU run is planned for the GPU without one here)
        done = cli(*words[3:], "--dry-run", env=env)
        assert done.returncode == 0, done.stderr
    elif kind == "cli-pipe":
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, **env})
        assert done.returncode == 0 and done.stdout.strip(), (command, done.stderr[-2000:])
    elif kind == "cli-template":
        from grpo_pipeline.flows.grpo import build_parser

        build_parser().parse_args([w for w in words[3:] if w != "PIPE"][: (words.index("PIPE") - 3) if "PIPE" in words else None])
    elif kind == "module":
        done = subprocess.run([*words[:3], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (command, done.stderr[-2000:])
    elif kind == "venv-tool":
        tool = words[0].removeprefix(".venv/bin/")
        if tool == "pip":
            extras = re.findall(r"\.\[([a-z,]+)\]", command)[0].split(",")
            declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            assert set(extras) <= set(declared), extras
        else:
            subcommand = [w for w in words[1:] if not w.startswith("-")][:1] if tool in ("prefect", "mlflow", "wandb") else []
            if tool == "prefect":
                subcommand = [w for w in words[1:3] if not w.startswith("-") and "/" not in w]
            done = subprocess.run([str(ROOT / ".venv" / "bin" / tool), *subcommand, "--help"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (command, done.stderr[-2000:])
    elif kind == "own-venv":
        scripts = [w for w in words if w.startswith("tools/")]
        assert all((ROOT / w).is_file() for w in scripts), scripts
        installs = words[words.index("install") + 1:] if "install" in words else []
        assert all("==" in requirement for requirement in installs), installs
