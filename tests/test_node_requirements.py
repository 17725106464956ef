"""What a cluster run requires of each node, and how a node's answer is judged (no Ray here: the
preflight on a real cluster whose nodes differ is tests/e2e/test_preflight.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_pipeline.backends import backend_for
from grpo_pipeline.cluster.node_image import look
from grpo_pipeline.cluster.preflight import Preflight
from node_images import TORCH_RELEASE
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.requirements import NodeFacts, NodeRequirement, node_problems

ROOT = Path(__file__).resolve().parents[1]


def _facts(node: str = "10.0.0.1 (aaaaaaaa)", **fields) -> NodeFacts:
    versions = {"python": "3.12.3", "torch": "2.11.0", "verl": "0.9.1", "megatron-core": "0.16.1", "vllm": "0.24.0",
                "nvidia-driver": "570.86", "mbridge": "0.15.1", "TransferQueue": "0.1.10"}
    versions |= fields.pop("versions", {})
    return NodeFacts(node=node, versions=versions, torch_build=fields.pop("torch_build", "cuda 12.8"),
                     devices=fields.pop("devices", 8), devices_offered=fields.pop("devices_offered", 8), **fields)


def _gpu_requirements(*overrides: str) -> dict[str, NodeRequirement]:
    profile = resolve_profile("qwen3.5-122b-a10b", "gpu", "verl", overrides=list(overrides))
    return backend_for("verl").node_requirements(profile, "train")


def test_the_layers_fill_the_requirements_and_the_profile_wins_by_name():
    train = _gpu_requirements()
    # the platform's runtime, verl's own, the recipe's layers; the recipe's megatron-core floor (GDN) wins
    assert {"torch", "nvidia-driver", "devices", "vllm", "verl", "TransferQueue", "megatron-core", "mbridge",
            "flash-linear-attention", "transformer-engine"} == set(train)
    assert train["megatron-core"].version == ">=0.16" and train["verl"].version == "==0.9.1"
    assert (train["mbridge"].knows, train["mbridge"].registry) == ("qwen3_5_moe", "mbridge.core.bridge:_MODEL_REGISTRY")
    other = _gpu_requirements("engine.vanilla_mbridge=false")
    assert "mbridge" not in other and other["megatron-bridge"].knows == "Qwen3_5MoeForConditionalGeneration"
    assert "transformer-engine" not in _gpu_requirements("requires.transformer-engine=null")
    # evaluating on the cluster needs the device's runtime, not the training libraries
    profile = resolve_profile("qwen3.5-122b-a10b", "gpu", "verl")
    assert set(backend_for("verl").node_requirements(profile, "evaluate")) == {"torch", "nvidia-driver", "devices", "vllm"}
    assert backend_for("local").node_requirements(resolve_profile("tiny", "cpu"), "train") == {}


@pytest.mark.parametrize(("change", "expected"), [
    ({"torch_build": "cpu"}, "torch 2.11.0 is a cpu build, the job needs a cuda build"),
    ({"versions": {"verl": "0.9.0"}}, "verl 0.9.0 is installed, the job needs verl==0.9.1"),
    ({"versions": {"verl": "not-a-version"}}, "verl not-a-version is installed, the job needs verl==0.9.1"),
    ({"versions": {"vllm": None}}, "vllm is not installed"),
    ({"versions": {"nvidia-driver": None}}, "nvidia-driver is not installed"),
    ({"devices": 4}, "Ray offers 8 devices here but the node has 4"),
    ({"imports": {"vllm": "ImportError: libcudart.so.12: cannot open shared object file"}},
     "vllm 0.24.0 is installed but does not import (vllm: ImportError: libcudart.so.12: cannot open shared object file)"),
    ({"registries": {"mbridge.core.bridge:_MODEL_REGISTRY": ["qwen2", "qwen3", "qwen3_moe"]}},
     "mbridge 0.15.1 does not know qwen3_5_moe (it knows qwen2, qwen3, qwen3_moe)"),
    ({"registries": {"mbridge.core.bridge:_MODEL_REGISTRY": "ModuleNotFoundError: No module named 'einops'"}},
     "mbridge 0.15.1: its list of models (mbridge.core.bridge:_MODEL_REGISTRY) could not be read: "
     "ModuleNotFoundError: No module named 'einops'"),
])
def test_each_mismatch_is_named_with_what_was_found(change, expected):
    needs = {name: need for name, need in _gpu_requirements().items()
             if name not in ("flash-linear-attention", "transformer-engine")}
    healthy = _facts(registries={"mbridge.core.bridge:_MODEL_REGISTRY": ["qwen3_5", "qwen3_5_moe"]},
                     imports={"vllm": None, "transfer_queue": None})
    assert node_problems(healthy, needs) == []
    broken = healthy.model_copy(update={k: (healthy.versions | v if k == "versions" else v) for k, v in change.items()})
    (problem,) = node_problems(broken, needs)
    assert problem.found == expected
    assert str(problem).startswith(expected + " (") and "; fix: " in str(problem)


def test_fsdp_needs_neither_megatron_core_nor_a_bridge_and_flash_attn_only_when_chosen():
    profile = resolve_profile("smollm2-135m", "gpu", "verl")
    train = backend_for("verl").node_requirements(profile, "train")
    # arith has no scorer in verl: the pipeline's reward runs in verl's reward workers (math-verify, pydantic)
    assert {"torch", "nvidia-driver", "devices", "vllm", "verl", "TransferQueue", "math-verify", "pydantic"} == set(train)
    assert train["TransferQueue"].imports == ["transfer_queue"] and "use_v1" in train["TransferQueue"].why
    flash = resolve_profile("smollm2-135m", "gpu", "verl", overrides=["engine.attn_implementation=flash_attention_2"])
    needs = backend_for("verl").node_requirements(flash, "train")
    assert needs["flash-attn"].imports == ["flash_attn"] and "engine.attn_implementation=sdpa" in needs["flash-attn"].fix


def test_torch_npu_and_vllm_ascend_must_be_releases_of_torch_and_vllm():
    needs = {name: NodeRequirement(same_release_as=other) for name, other in
             (("torch-npu", "torch"), ("vllm-ascend", "vllm"))}
    matching = _facts(versions={"torch": "2.10.0+cpu", "torch-npu": "2.10.0.post4", "vllm": "0.23.0+empty",
                                "vllm-ascend": "0.23.0rc1"})
    assert node_problems(matching, needs) == []
    off = _facts(versions={"torch": "2.11.0", "torch-npu": "2.10.0.post4", "vllm": None, "vllm-ascend": "0.23.0"})
    assert [p.found for p in node_problems(off, needs)] == [
        "torch-npu 2.10.0.post4 does not match torch 2.11.0: their releases must be the same",
        "vllm-ascend 0.23.0 does not match vllm (not installed): their releases must be the same"]
    # Neither had a release, so "both None" matched and the job was submitted.
    unversioned = _facts(versions={"torch": "banana", "torch-npu": "banana", "vllm": "0.23.0", "vllm-ascend": "0.9.0-custom"})
    assert [p.found for p in node_problems(unversioned, needs)] == [
        "torch-npu banana is not a PEP 440 version, so its release cannot be matched with torch's; install a released build",
        "vllm-ascend 0.9.0-custom is not a PEP 440 version, so its release cannot be matched with vllm's; install a "
        "released build"]


@pytest.mark.parametrize("version", ["=>banana", "==", "0.9.1", ">=1.0;<2"])
def test_a_version_that_is_no_specifier_is_refused_at_planning(version):
    """It passed planning and then matched no node's version: every node was blamed."""
    from grpo_pipeline.errors import ProfileError

    with pytest.raises(ProfileError, match=f"requires.vllm.version={version!r}: .* is not a PEP 440 version specifier; "
                       "write one like ==0.9.1"):
        resolve_profile("qwen3.5-122b-a10b", "gpu", "verl", overrides=[f'requires.vllm={{version: "{version}"}}'])


def test_a_package_whose_metadata_is_not_text_is_named_with_its_fix(tmp_path, monkeypatch):
    """Garbage METADATA raised out of the node's task (RayTaskError(UnicodeDecodeError), in ANSI colours,
    naming no package); it is that node's answer, judged like any other."""
    from node_images import install

    install(tmp_path, "vllm", "0.23.0")
    (tmp_path / "vllm-0.23.0.dist-info" / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: vllm\nVersion: \xff\xfe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    answer = look({"vllm": {"version": ">=0.20"}}, timeout_s=60)
    assert answer["versions"]["vllm"] is None and answer["unreadable"]["vllm"].startswith("UnicodeDecodeError: ")
    (problem,) = node_problems(_facts(versions=answer["versions"], unreadable=answer["unreadable"]),
                               {"vllm": NodeRequirement(version=">=0.20")})
    assert problem.found.startswith("vllm is installed but its package metadata cannot be read (UnicodeDecodeError: ")
    assert problem.found.endswith("): the installation is damaged; reinstall vllm on the node")


@pytest.mark.e2e  # runs the node check or the command line as a subprocess
def test_an_import_that_prints_without_a_final_newline_is_still_read(tmp_path, monkeypatch):
    """The marker line was glued to the module's output, and a healthy node was refused."""
    (tmp_path / "chatty.py").write_text("import sys\nsys.stdout.write('loading kernels...')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    answer = look({"torch": {"imports": ["chatty"]}}, timeout_s=60)
    assert answer["imports"] == {"chatty": None}


@pytest.mark.e2e  # runs the node check or the command line as a subprocess
def test_the_node_answers_from_metadata_and_a_crashing_import_is_named_not_fatal(tmp_path, monkeypatch):
    (tmp_path / "crashes_on_import.py").write_text("import os\nos.abort()\n")
    (tmp_path / "zoo.py").write_text("MODELS = {'qwen3': 1, 'llama': 2}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    needs = {"torch": {"torch_build": "cuda", "imports": ["crashes_on_import"]},
             "pydantic": {"registry": "zoo:MODELS", "knows": "qwen3"},
             "no-such-distribution": {}}
    answer = look(needs, timeout_s=60)
    assert answer["versions"]["torch"].startswith(TORCH_RELEASE) and answer["torch_build"] == "cpu"
    assert answer["versions"]["no-such-distribution"] is None and answer["versions"]["python"]
    assert answer["imports"]["crashes_on_import"] == "the importing process ended with exit code -6"
    assert answer["registries"]["zoo:MODELS"] == ["llama", "qwen3"]


@pytest.mark.e2e  # runs the node check or the command line as a subprocess
def test_a_hung_import_is_named_after_its_share_of_the_timeout(tmp_path, monkeypatch):
    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    answer = look({"torch": {"imports": ["hangs"]}}, timeout_s=5)
    assert answer["imports"]["hangs"] == "the import did not finish in 4 s"


def test_identical_nodes_are_one_column_and_one_line():
    needs = {"verl": NodeRequirement(version="==0.9.1", fix="pip install verl==0.9.1")}
    nodes = [_facts(f"10.0.0.{i} ({i:08d})") for i in range(64)]
    nodes[7] = _facts("10.0.0.7 (00000007)", versions={"verl": "0.8.0"})
    nodes[9] = _facts("10.0.0.9 (00000009)", versions={"verl": "0.8.0", "vllm": "0.23.0"})
    checked = Preflight(stage="train", seconds=1.5, requirements=needs, nodes=nodes,
                        silent=["node 10.0.0.99 (00000099): did not answer the preflight in 120 s (...)"])
    lines = checked.refusal().splitlines()
    assert lines == [
        "3 of 65 Ray nodes cannot run the train stage; nothing was submitted:",
        "  2 nodes (10.0.0.7 (00000007), 10.0.0.9 (00000009)): verl 0.8.0 is installed, the job needs verl==0.9.1; "
        "fix: pip install verl==0.9.1",
        "  node 10.0.0.99 (00000099): did not answer the preflight in 120 s (...)"]
    table = checked.table()
    assert table[0].count("|") == 5  # a label column and one per distinct image: 62 nodes, then 2 singles
    assert "62 nodes (10.0.0.0 (00000000), 10.0.0.1 (00000001), 10.0.0.2 (00000002) and 59 more)" in table[0]
    verl_row = next(line for line in table if line.startswith("| verl |"))
    assert verl_row == "| verl | 0.9.1 | 0.8.0 | 0.8.0 |"
    assert table[-1].startswith("- node 10.0.0.99")
    assert Preflight(stage="train", seconds=0.2, requirements=needs, nodes=nodes[:3]).refusal() is None


@pytest.mark.e2e  # runs the node check or the command line as a subprocess
def test_the_dry_run_lists_each_stage_s_node_requirements():
    done = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--model", "qwen3.5-122b-a10b", "--device", "npu",
                           "--dry-run", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    needs = json.loads(done.stdout)["node_requirements"]
    assert needs["train"]["torch-npu"] == {"same_release_as": "torch", "why": "torch on Ascend NPUs", "fix": (
        "install the torch_npu release of the node's torch (torch X.Y.Z needs torch_npu X.Y.Z[.postN])")}
    assert needs["train"]["megatron-bridge"]["knows"] == "Qwen3_5MoeForConditionalGeneration"
    assert "mindspeed" in needs["train"] and "mindspeed" not in needs["evaluate"]
    text = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--model", "qwen3.5-122b-a10b", "--device", "npu",
                           "--dry-run"], capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    assert "# node requirements of the train stage (checked on every Ray node before it starts there)" in text
    assert "#   vllm-ascend (same release as vllm): the rollout engine on NPUs" in text


@pytest.mark.e2e  # starts child processes
def test_a_check_that_could_not_start_blames_no_package(tmp_path, monkeypatch):
    """A child that never ran (its interpreter failed at start, e.g. the working directory of a raylet started
    in a folder replaced since) was reported as "TransferQueue ... does not import", sending the user after
    the wrong package; the node's problem now says the check could not start, with the child's last line."""
    from grpo_pipeline.cluster import node_image

    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'Python path configuration:' >&2\n"
                       "echo 'Fatal Python error: init_fs_encoding: failed to get the Python codec' >&2\nexit 2\n")
    failing.chmod(0o755)
    monkeypatch.setattr(node_image.sys, "executable", str(failing))
    answer = look({"pydantic": {"imports": ["pydantic"]}, "packaging": {"imports": ["packaging"]}}, timeout_s=60)
    said = ("the check could not start (exit code 2: Fatal Python error: init_fs_encoding: failed to get the Python "
            "codec)")
    assert answer["imports"] == {"pydantic": said, "packaging": said}
    facts = _facts(imports={"transfer_queue": said})
    needs = {"TransferQueue": NodeRequirement(imports=["transfer_queue"])}
    (problem,) = node_problems(facts.model_copy(update={"versions": facts.versions | {"TransferQueue": "0.1.11"}}), needs)
    assert problem.found == f"TransferQueue 0.1.11 is installed but could not be checked: {said}; the node's Python could not run"
    monkeypatch.setattr(node_image.sys, "executable", str(tmp_path / "gone"))
    answer = look({"pydantic": {"imports": ["pydantic"]}}, timeout_s=60)
    assert answer["imports"]["pydantic"].startswith(f"the check could not start ({tmp_path / 'gone'}: No such file")
