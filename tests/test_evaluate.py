"""The evaluation stage: metrics recomputed independently from the per-sample file, exact scores
through a stand-in engine, and bad input refused before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets_fixtures import geo3k_table, gsm8k_table
from grpo_pipeline.errors import UserError
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.stages.evaluate import EvalSettings, Response, evaluate, pass_at_k
from grpo_pipeline.rewards.builtin import score
from grpo_pipeline.data.rl_data import arith_splits, convert_geo3k, convert_gsm8k


def write(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path)
    return path


def test_tiny_on_arith_metrics_match_the_per_sample_file(tiny_model_dir, tmp_path):
    val = write(arith_splits(8, 24, seed=1)["test"], tmp_path / "test.parquet")
    settings = EvalSettings(samples_per_prompt=3, temperature=1.0, max_new_tokens=6, batch_size=5, seed=2)
    report = evaluate({"base": tiny_model_dir}, val, settings, tmp_path / "eval")
    (metrics,) = report.models
    samples = [json.loads(line) for line in Path(metrics.samples_file).read_text().splitlines()]
    assert len(samples) == 24 * 3 and metrics.prompts == 24 and metrics.samples == 72
    rewards = np.array([s["reward"] for s in samples])
    for s in samples:  # each record's score is the reward of its own response
        assert score(s["data_source"], s["response"], s["ground_truth"]).reward == s["reward"]
    assert metrics.mean_reward == pytest.approx(rewards.mean())
    assert metrics.accuracy == pytest.approx(np.mean([s["correct"] for s in samples]))
    assert metrics.format_rate == pytest.approx(np.mean([s["formatted"] for s in samples]))
    assert metrics.truncation_rate == pytest.approx(np.mean([s["truncated"] for s in samples]))
    lengths = np.array([s["response_tokens"] for s in samples])
    assert metrics.response_length_mean == pytest.approx(lengths.mean())
    assert metrics.response_length_p95 == np.percentile(lengths, 95, method="inverted_cdf")
    assert all(s["response_tokens"] <= 6 and (not s["truncated"] or s["response_tokens"] == 6) for s in samples)
    per_prompt = {}
    for s in samples:
        per_prompt.setdefault(s["prompt_index"], []).append(s)
    expected_pass = np.mean([any(x["correct"] for x in group) for group in per_prompt.values()])
    assert metrics.k == 3 and metrics.pass_at_k == pytest.approx(expected_pass)
    low, high = metrics.reward_ci95
    prompt_means = [np.mean([x["reward"] for x in g]) for g in per_prompt.values()]
    assert low <= np.mean(prompt_means) <= high and high - low <= 4 * np.std(prompt_means) / math.sqrt(24) + 1e-9


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5


def echo_engine(answers: dict[str, str]):
    """A model that answers each prompt with a known response (the engine boundary)."""

    def generate(model_dir, prompts, settings):
        return [[Response(text=answers[p[-1]["content"]], tokens=len(answers[p[-1]["content"]].split()), truncated=False)]
                * settings.samples_per_prompt for p in prompts]

    return generate


def test_gsm8k_and_geo3k_are_scored_exactly(tiny_model_dir, tmp_path):
    gsm8k = convert_gsm8k(gsm8k_table(4), "test").to_pylist()
    responses = {
        gsm8k[0]["prompt"][0]["content"]: f"so\n#### {gsm8k[0]['reward_model']['ground_truth']}",  # right
        gsm8k[1]["prompt"][0]["content"]: "#### 12345",  # wrong number
        gsm8k[2]["prompt"][0]["content"]: f"The answer is {gsm8k[2]['reward_model']['ground_truth']}",  # no ####
        gsm8k[3]["prompt"][0]["content"]: f"#### {gsm8k[3]['reward_model']['ground_truth']}",  # right
    }
    val = write(convert_gsm8k(gsm8k_table(4), "test"), tmp_path / "gsm8k.parquet")
    (m,) = evaluate({"echo": tiny_model_dir}, val, EvalSettings(), tmp_path / "eval", echo_engine(responses)).models
    assert (m.mean_reward, m.accuracy, m.format_rate) == (0.5, 0.5, 0.75)

    geo = convert_geo3k(geo3k_table(4), "test").to_pylist()
    truths = [row["reward_model"]["ground_truth"] for row in geo]
    answers = {
        geo[0]["prompt"][0]["content"]: f"<think>sum</think> \\boxed{{{truths[0]}}}",  # 1.0
        geo[1]["prompt"][0]["content"]: f"\\boxed{{{truths[1]}}}",  # 0.9: right, no think block
        geo[2]["prompt"][0]["content"]: "<think>x</think> \\boxed{0}",  # 0.1: format only
        geo[3]["prompt"][0]["content"]: "no idea",  # 0
    }
    val = write(convert_geo3k(geo3k_table(4), "test"), tmp_path / "geo3k.parquet")
    (m,) = evaluate({"echo": tiny_model_dir}, val, EvalSettings(), tmp_path / "eval", echo_engine(answers)).models
    assert m.mean_reward == pytest.approx(0.5) and m.accuracy == 0.5 and m.format_rate == 0.5


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no-weights", "no safetensors weights"),
        ("no-ground-truth", "row 0 has no reward_model.ground_truth"),
        ("no-reward-column", "no reward_model column"),
        ("empty", "the validation split is empty"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_is_written(tiny_model_dir, tmp_path, breakage, message):
    model, table = tiny_model_dir, arith_splits(4, 4, seed=0)["test"]
    if breakage == "no-weights":
        model = tmp_path / "no-weights"
        model.mkdir()
        (model / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    elif breakage == "no-ground-truth":
        table = table.set_column(3, "reward_model", pa.array([{"style": "rule", "ground_truth": ""}] * 4))
    elif breakage == "no-reward-column":
        table = table.drop_columns(["reward_model"])
    else:
        table = table.slice(0, 0)
    val = write(table, tmp_path / "val.parquet")
    with pytest.raises(UserError, match=message):
        evaluate({"m": model}, val, EvalSettings(), tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_several_samples_need_sampling():
    from grpo_pipeline.stages.plan import resolve_profile

    with pytest.raises(UserError, match="eval.samples_per_prompt=4 with eval.temperature=0"):
        profile = resolve_profile("tiny", "cpu", overrides=["eval.samples_per_prompt=4"])
        EvalSettings.from_profile(profile, GenerationPlan())


def test_generation_runs_where_the_platform_says():
    from grpo_pipeline.stages.plan import resolve_profile

    from grpo_pipeline.generation.plan import plan_generation

    cpu, npu = (EvalSettings.from_profile(p, plan_generation(p)) for p in (resolve_profile("tiny", "cpu"),
                                                                           resolve_profile("qwen3.5-122b-a10b", "npu")))
    assert (cpu.torch_device, cpu.dtype) == ("cpu", "float32") and (npu.torch_device, npu.dtype) == ("npu", "bfloat16")


@pytest.mark.e2e  # starts a local Ray
def test_sharded_generation_returns_every_prompt_in_order(tiny_model_dir):
    import ray

    from grpo_pipeline.profiles.platform import Platform
    from grpo_pipeline.generation.engines import transformers_generate
    from grpo_pipeline.generation.sharding import sharded

    prompts = [row["prompt"] for row in arith_splits(4, 10, seed=3)["test"].to_pylist()]
    settings = EvalSettings(max_new_tokens=5, batch_size=4)
    try:
        merged = sharded(transformers_generate, 2, Platform())(tiny_model_dir, prompts, settings)
    finally:
        ray.shutdown()
    assert merged == transformers_generate(tiny_model_dir, prompts, settings)  # greedy: the same, in order


def test_the_vllm_engine_translates_settings_and_outputs(tiny_model_dir, monkeypatch):
    """vLLM cannot be installed here: its two classes are stood in to check the adapter's side."""
    import sys
    import types
    from dataclasses import dataclass

    from grpo_pipeline.generation.engines import transformers_generate, vllm_generate
    from grpo_pipeline.generation.sharding import choose_engine

    seen = {}

    @dataclass
    class Completion:
        text: str
        token_ids: list
        finish_reason: str

    class LLM:
        def __init__(self, model, seed, tensor_parallel_size):
            seen["model"], seen["seed"], seen["tp"] = model, seed, tensor_parallel_size

        def chat(self, prompts, params, use_tqdm):
            seen["params"] = params
            return [types.SimpleNamespace(outputs=[Completion(f"{i}-{j}", [1] * (j + 1), "length" if j else "stop")
                                                   for j in range(params["n"])]) for i, _ in enumerate(prompts)]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    settings = EvalSettings(samples_per_prompt=2, temperature=0.7, max_new_tokens=9, seed=5, tensor_parallel_size=4)
    out = vllm_generate(tiny_model_dir, [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], settings)
    assert seen["params"] == {"n": 2, "temperature": 0.7, "max_tokens": 9, "seed": 5} and seen["model"] == str(tiny_model_dir)
    assert seen["tp"] == 4  # a cluster evaluation's engine spans rollout.tp devices
    assert [[r.text for r in group] for group in out] == [["0-0", "0-1"], ["1-0", "1-1"]]
    assert [r.truncated for r in out[0]] == [False, True] and out[0][1].tokens == 2
    from grpo_pipeline.profiles.platform import Platform

    assert choose_engine(Platform(), 4, GenerationPlan()) is transformers_generate  # the CPU: transformers, not sharded
    assert choose_engine(Platform(), 4, GenerationPlan(engine="vllm", decoder=None)) is vllm_generate  # the plan's engine


def test_the_native_decoder_evaluates_as_generate_does(tiny_model_dir):
    from grpo_pipeline.generation.engines import transformers_generate

    prompts = [row["prompt"] for row in arith_splits(8, 6, seed=3)["test"].to_pylist()]
    greedy = [transformers_generate(tiny_model_dir, prompts, EvalSettings(max_new_tokens=8, batch_size=4,
                                                                          plan=GenerationPlan(decoder=decoder)))
              for decoder in ("generate", "native")]  # batches of 4 and 2: the second in the first one's cache
    assert greedy[0] == greedy[1] and len(greedy[1]) == 6
    sampled = transformers_generate(tiny_model_dir, prompts, EvalSettings(
        max_new_tokens=8, batch_size=4, plan=GenerationPlan(decoder="native"), samples_per_prompt=3, temperature=1.0))
    assert [len(group) for group in sampled] == [3] * 6
    assert all(r.tokens <= 8 and r.truncated == (r.tokens == 8) for group in sampled for r in group)


def test_generation_time_is_reported_beside_the_rollouts(tiny_model_dir, tmp_path):
    from grpo_pipeline.backends.metrics import StepMetrics, append_metrics

    for step, seconds in ((1, 2.5), (2, 0.0), (3, 1.5)):  # two generation rounds, the second step reused one
        append_metrics(tmp_path / "metrics.jsonl", StepMetrics(step=step, reward_mean=0.0, step_time_s=3.0,
                                                               generation_s=seconds, time=0.0))
    rows = arith_splits(8, 4, seed=0)["test"]
    answers = {row["prompt"][-1]["content"]: "the answer is 4" for row in rows.to_pylist()}
    report = evaluate({"base": tiny_model_dir}, write(rows, tmp_path / "val.parquet"), EvalSettings(), tmp_path / "eval",
                      echo_engine(answers))
    (metrics,) = report.models
    assert metrics.generated_tokens == 4 * 4 and metrics.generation_s is not None
    assert f"generated 16 tokens in {metrics.generation_s:.1f} s" in metrics.summary_line()
    assert report.generation.startswith("rollouts 4.0 s in 2 generation rounds (2.0 s a round); evaluation of base ")


@pytest.mark.e2e  # starts child processes
@pytest.mark.parametrize("ending", ["os._exit(0)", "sys.exit(0)", "raise SystemExit(3)"])
def test_a_user_reward_that_ends_its_process_fails_the_evaluation(tiny_model_dir, tmp_path, ending):
    """Issue 55: a reward calling os._exit(0) on an evaluation row ended the flow with exit code 0, no error line
    and no report; it runs in a child now, and any way it ends is that reward's failure."""
    from grpo_pipeline.rewards.functions import RewardError
    from grpo_pipeline.rewards.plan import FunctionEntry, RewardPlan

    reward = tmp_path / "ends.py"
    reward.write_text("import os, sys\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    if extra_info['index'] == 1:\n        {ending}\n    return 1.0\n")
    rows = arith_splits(4, 3, seed=1)["test"]
    val = write(rows, tmp_path / "test.parquet")
    answers = {row["prompt"][-1]["content"]: "7" for row in rows.to_pylist()}
    settings = EvalSettings(reward=RewardPlan(functions=[FunctionEntry(spec=f"{reward}:compute_score")]))
    with pytest.raises(RewardError, match="reward"):
        evaluate({"echo": tiny_model_dir}, val, settings, tmp_path / "eval", echo_engine(answers))
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    print('scoring', flush=True)\n    return 0.5\n")
    (m,) = evaluate({"echo": tiny_model_dir}, val, settings, tmp_path / "eval", echo_engine(answers)).models
    assert m.mean_reward == 0.5  # a healthy reward of the user's, printing as it scores, as before


@pytest.mark.e2e  # starts a child process
def test_a_user_reward_that_hangs_in_evaluation_fails_within_its_limit(tiny_model_dir, tmp_path):
    """Issue 55: a reward that hung in evaluation hung the run forever (training and the check had limits)."""
    from grpo_pipeline.rewards.functions import RewardError
    from grpo_pipeline.rewards.plan import FunctionEntry, RewardPlan

    reward = tmp_path / "hangs.py"
    reward.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(600)\n")
    rows = arith_splits(4, 2, seed=1)["test"]
    val = write(rows, tmp_path / "test.parquet")
    answers = {row["prompt"][-1]["content"]: "7" for row in rows.to_pylist()}
    settings = EvalSettings(reward=RewardPlan(functions=[FunctionEntry(spec=f"{reward}:compute_score")], eval_timeout_s=5))
    with pytest.raises(RewardError, match=r"did not end within 5 s \(reward.eval_timeout_s\)"):
        evaluate({"echo": tiny_model_dir}, val, settings, tmp_path / "eval", echo_engine(answers))
