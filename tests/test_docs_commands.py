"""What the docs tell a person to run, run: every `grpo_pipeline.flows.grpo` command of a bash block in README.md
and docs/*.md that plans without starting anything (`--dry-run`, `--suggest-layout`) exits 0 here, the
sample profile file of docs/configuration.md loads, and the dry run's resolved profile loads back as
a profile file and plans the same run."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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
