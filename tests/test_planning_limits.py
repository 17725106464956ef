"""What planning refuses in one line (exit 2) before it would crash, hang or search without end:
numbers the memory planner multiplies (infinite, huge), an accelerator without a row, profile files
that never end, a custom reward that training could not load."""

from __future__ import annotations

import os

import pytest

QWEN = ("--model", "qwen3.5-122b-a10b", "--device", "gpu")


def one_error_line(done) -> str:
    """The refusal: one headline, and any further problems as indented detail lines below it, joined."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and lines and lines[0].startswith("error: "), (done.returncode, lines)
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert "Traceback" not in done.stdout + done.stderr
    return " ".join(line.strip() for line in lines)


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


@pytest.mark.e2e  # the planning check imports the reward in a subprocess
def test_a_custom_reward_training_could_not_load_is_refused_when_the_run_is_planned(cli, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("import math\n\ndef exact(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str == ground_truth)\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def exact(data_source, solution_str:\n")
    planned = ("--model", "tiny", "--device", "cpu", "--dry-run", "--set")
    cases = {
        f"{tmp_path}/missing.py:exact": "missing.py is not a file; give the path of a Python file",
        f"{reward}:score": f"{reward} defines no 'score' at its top level",
        f"{broken}:exact": f"{broken} line 1 is not valid Python",
        f"{reward}:not-a-name": "expected /path/to/file.py:function",
    }
    for spec, fragment in cases.items():
        assert fragment in one_error_line(cli(*planned, f"reward.functions=[{spec}]")), spec
    assert cli(*planned, f"reward.functions=[{reward}:exact]").returncode == 0
    # a top-level name that is no function (an imported module) is no reward
    assert f"{reward} defines no function 'math'" in one_error_line(cli(*planned, f"reward.functions=[{reward}:math]"))


@pytest.mark.parametrize(("settings", "fragment"), [
    # TRL refused it after 63 s, 3 attempts
    ({"algorithm": {"rollout_n": 1}}, "algorithm.rollout_n=1: GRPO scores each response against the others sampled "
     "for its prompt, so a group needs at least 2; set algorithm.rollout_n >= 2"),
    # the documented bound allocated 137 GB on the tiny model; its positions end at 512
    ({"data": {"max_response_length": 16777216}}, "data.max_response_length=16777216: data.max_prompt_length 64 + "
     "16777216 = 16777280 tokens, more than the model's max_position_embeddings 512; set data.max_response_length <= 448"),
    ({"eval": {"max_new_tokens": 449}}, "eval.max_new_tokens=449: data.max_prompt_length 64 + 449 = 513 tokens"),
    ({"data": {"max_prompt_length": 600}}, "lower data.max_prompt_length below 512"),
    # refused only by the evaluation stage, after training
    ({"eval": {"samples_per_prompt": 4, "temperature": 0}}, "eval.samples_per_prompt=4 with eval.temperature=0: greedy "
     "decoding gives the same response every time"),
    # 3 Ray jobs were submitted; the dry run itself gave a traceback for the roots
    ({"trainer": {"entrypoint": "python3 -m verl\0.trainer.main_ppo"}}, "trainer.entrypoint='python3 -m verl\\x00.trainer"
     ".main_ppo': contains a NUL character (\\0), which no path, name or command can hold; remove it"),
    ({"data": {"root": "/tmp/data\0"}}, "data.root='/tmp/data\\x00': contains a NUL character"),
    ({"model": {"root": "/tmp/models\0"}}, "model.root='/tmp/models\\x00': contains a NUL character"),
    ({"model": {"files": ["*.json\0"]}}, "contains a NUL character"),
], ids=["rollout-n-1", "response-longer-than-the-model", "eval-tokens-longer-than-the-model", "prompt-alone-too-long",
        "greedy-eval-with-4-samples", "nul-in-entrypoint", "nul-in-data-root", "nul-in-model-root", "nul-in-model-files"])
@pytest.mark.parametrize("target", [("--device", "cpu"), ("--device", "gpu", "--backend", "verl")], ids=["local", "verl"])
def test_a_setting_that_would_fail_late_is_refused_at_planning(cli, tmp_path, settings, fragment, target):
    """Each failed only once training ran (or was retried); planning knows it (a NUL cannot be given
    by --set: argv holds none, so the profile file carries it)."""
    import json

    profile = tmp_path / "profile.yaml"
    profile.write_text(json.dumps(settings))  # JSON is YAML; "\0" survives as its escape
    line = one_error_line(cli("--model", "tiny", *target, "--profile-file", str(profile), "--dry-run",
                              "--run-dir", str(tmp_path / "runs")))
    assert fragment in line
    assert not (tmp_path / "runs").exists()


def test_a_model_whose_kv_heads_outnumber_its_heads_is_refused_at_planning(cli, tmp_path):
    import json

    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 8, "hidden_size": 64, "vocab_size": 512,
              "intermediate_size": 128, "max_position_embeddings": 512}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    line = one_error_line(cli("--model", str(tmp_path / "model"), "--device", "cpu", "--dry-run"))
    assert "model.architecture.num_kv_heads=8: the 4 attention heads do not split into groups of one KV head each" in line


@pytest.mark.parametrize(("nnodes", "fix"), [
    # said "add nodes": every layout's data-parallel ranks outnumbered the batch's sequences
    ("16384", "every layout has more data-parallel ranks than data.train_batch_size 128 x algorithm.rollout_n 6 = 768 "
              "sequences split over; use fewer nodes (--set cluster.nnodes=N) or a larger data.train_batch_size"),
    ("1", "add nodes (--set cluster.nnodes=N)"),  # nothing fits in memory: more devices do help
])
def test_no_layout_fitting_names_the_way_the_cluster_is_wrong(cli, nnodes, fix):
    line = one_error_line(cli(*QWEN, "--suggest-layout", "--set", f"cluster.nnodes={nnodes}"))
    assert line.endswith(f"devices; {fix}"), line


def test_a_length_whose_rollouts_cannot_fit_in_memory_is_refused_at_planning(cli):
    """The issue's probe: data.max_response_length=16777216 (the documented bound) allocated 137 GB on
    the tiny model. Planning sizes the rollouts' KV cache (32 sequences per worker x 16777280
    positions x 2 layers x K and V x 2 KV heads x 16 x 4 bytes, plus token ids and log-probs) with the
    weights against the memory there is, and says the largest length that fits."""
    memory = ("--set", "platform.device_memory_gib=64")  # the host's available memory otherwise
    line = one_error_line(cli("--model", "tiny", "--device", "cpu", "--dry-run", *memory,
                              "--set", "data.max_response_length=16777216"))
    assert ("data.max_response_length=16777216: rollouts need 281321858560 bytes (262.0 GiB: 32 sequences per worker "
            "x 16777280 positions of KV cache, with the weights), more than the 64.0 GiB of platform.device_memory_gib; "
            "set data.max_response_length <= 4098161") in line
    assert "more than the model's max_position_embeddings 512" in line  # the other rule, on the same line
    # a length the model allows, but not a memory this small: only the memory rule speaks
    line = one_error_line(cli("--model", "tiny", "--device", "cpu", "--dry-run", "--set", "platform.device_memory_gib=0.002",
                              "--set", "data.max_response_length=448"))
    assert "data.max_response_length=448: rollouts need" in line and "max_position_embeddings" not in line
    fits = cli("--model", "tiny", "--device", "cpu", "--dry-run", "--set", "platform.device_memory_gib=0.002")
    assert fits.returncode == 0, fits.stderr


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny"])
def test_the_recipes_own_lengths_fit_in_memory(cli, model):
    done = cli("--model", model, "--device", "cpu", "--dry-run")
    assert done.returncode == 0 and "rollouts need" not in done.stdout + done.stderr, done.stderr
