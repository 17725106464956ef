"""The guards' parts that need no Ray (backends/guards.py): each guard's rule over step records, what the
backends measure for them (the local probe, verl's own metrics as its file logger writes them), the
checkpoint checks before a resume, the data order by epoch, and the report's panel. The faults injected
through the real engines are tests/e2e/test_local_guards.py and tests/e2e/test_verl_guards.py."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import orjson
import pytest
import torch

from grpo_pipeline.backends.guards import GuardTrip, GuardTripped, StepGuards, check_data_position, check_short_run
from grpo_pipeline.backends.local.checkpoints import missing_data_position
from grpo_pipeline.backends.metrics import StepMetrics, append_metrics, read_metrics
from grpo_pipeline.backends.verl.follow import TRACKER, VerlMetrics, total_steps, tracker_step
from grpo_pipeline.backends.verl.resume import keep_good_checkpoint, missing_dataloader_state
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.guards import GuardsSection
from grpo_pipeline.stages import guard_panel
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.run.folder import RunFolder


def step(n: int, **values) -> StepMetrics:
    return StepMetrics(**{"step": n, "reward_mean": 0.5, "step_time_s": 1.0, "time": 0.0, "loss": 0.1,
                          "grad_norm": 0.4, "mismatch": 1e-5, "zero_advantage_share": 0.25, **values})


def run(guards: StepGuards, records: list[StepMetrics]) -> GuardTrip | None:
    for record in records:
        if trip := guards.check(record):
            return trip
    return None


def test_a_mismatch_above_its_threshold_for_n_steps_in_a_row_stops_and_says_why():
    settings = GuardsSection(rollout_mismatch=0.05, rollout_mismatch_steps=3)
    values = [0.001, 0.2, 0.3, 0.01, 0.2, 0.3, 0.4]  # a dip below resets the count
    trip = run(StepGuards(settings), [step(n, mismatch=v) for n, v in enumerate(values, 1)])
    assert (trip.guard, trip.step) == ("rollout_mismatch", 7)
    assert trip.line.startswith("step 7: rollout vs trainer log-prob mismatch 0.2, 0.3, 0.4 (KL per token) in steps 5-7, "
                                "above 0.05: rollouts are not using the trained weights")
    assert trip.line.endswith("(guards.rollout_mismatch=off to run on)")
    # unmeasured steps never count; off records and never stops
    assert run(StepGuards(settings), [step(n, mismatch=None) for n in range(1, 9)]) is None
    assert run(StepGuards(GuardsSection(rollout_mismatch="off")), [step(n, mismatch=9.0) for n in range(1, 9)]) is None


def test_constant_groups_for_n_steps_or_a_reward_exactly_zero_from_the_start_stop():
    settings = GuardsSection(reward_collapse_steps=4)
    constant = [step(n, reward_mean=1.0, zero_advantage_share=1.0) for n in range(1, 7)]
    trip = run(StepGuards(settings), [step(1), step(2), *[s.model_copy(update={"step": s.step + 2}) for s in constant]])
    assert (trip.guard, trip.step) == ("reward_collapse", 6)
    assert "every group's rewards were constant in each of the last 4 steps (mean reward 1.0): zero advantage" in trip.line
    zero = [step(n, reward_mean=0.0, zero_advantage_share=None) for n in range(1, 9)]  # verl: share unknown
    trip = run(StepGuards(settings), zero)
    assert trip.step == 4 and "the mean reward was exactly 0 in each of the first 4 steps" in trip.line
    # a learning run: some groups vary, the reward moves off 0
    learning = [step(n, reward_mean=0.0 if n < 3 else 0.2, zero_advantage_share=1.0 if n < 3 else 0.5) for n in range(1, 12)]
    assert run(StepGuards(settings), learning) is None
    assert run(StepGuards(GuardsSection(reward_collapse_steps="off")), zero) is None


@pytest.mark.parametrize(("field", "value", "said"), [
    ("loss", math.nan, "loss nan"), ("grad_norm", math.inf, "grad norm inf"), ("reward_mean", math.nan, "reward nan"),
    ("mismatch", math.nan, "log-prob mismatch nan"), ("entropy", -math.inf, "entropy -inf")])
def test_a_non_finite_value_stops_at_once(field, value, said):
    trip = run(StepGuards(GuardsSection()), [step(1), step(2, **{field: value})])
    assert (trip.guard, trip.step) == ("non_finite", 2) and f"step 2: non-finite {said}" in trip.line
    assert run(StepGuards(GuardsSection(non_finite="off")), [step(1), step(2, **{field: value})]) is None


def test_a_skipped_or_repeated_step_stops_the_run_and_the_first_step_is_checked_against_the_resume():
    assert "the engine skipped step 3" in run(StepGuards(GuardsSection()), [step(1), step(2), step(4)]).line
    assert "the engine skipped steps 3-5" in run(StepGuards(GuardsSection()), [step(1), step(2), step(6)]).line
    assert "the engine trained step 2 again" in run(StepGuards(GuardsSection()), [step(1), step(2), step(2)]).line
    # resumed from checkpoint 4: its first step must be 5, with or without the earlier records
    assert run(StepGuards(GuardsSection(), [step(n) for n in range(1, 5)], 4), [step(5), step(6)]) is None
    assert "trained step 3 again" in run(StepGuards(GuardsSection(), [], 4), [step(3)]).line
    assert run(StepGuards(GuardsSection(short_run="off")), [step(1), step(3)]) is None


def test_an_engine_that_ends_early_or_a_checkpoint_without_its_data_position_stops_unless_off():
    with pytest.raises(GuardTripped, match=r"verl job j exited 0 at step 3 of the 6 it planned: training ended early"):
        check_short_run(GuardsSection(), 3, 6, "verl job j")
    check_short_run(GuardsSection(), 6, 6, "verl job j")
    check_short_run(GuardsSection(short_run="off"), 3, 6, "verl job j")
    with pytest.raises(GuardTripped, match=r"cannot resume from checkpoint global_step_2: it has no data.pt, so the"):
        check_data_position(GuardsSection(), 2, "it has no data.pt")
    check_data_position(GuardsSection(data_position="off"), 2, "it has no data.pt")


def test_a_tripped_guard_crosses_process_boundaries_as_itself():
    """A local worker raises it; Ray pickles it back to the driver, which must still know it (never retried)."""
    trip = GuardTrip(guard="non_finite", step=3, line="step 3: non-finite loss nan", kept="checkpoint global_step_2")
    again = pickle.loads(pickle.dumps(GuardTripped(trip)))
    assert isinstance(again, GuardTripped) and again.trip == trip
    assert str(again) == "step 3: non-finite loss nan; kept: checkpoint global_step_2"


def test_off_is_off_however_yaml_reads_it_and_bad_values_are_refused_in_one_line():
    profile = resolve_profile("tiny", "cpu", overrides=["guards.rollout_mismatch=off", "guards.non_finite=off",
                                                        "guards.reward_collapse_steps=off", "guards.short_run=false"])
    assert (profile.guards.rollout_mismatch, profile.guards.non_finite) == ("off", "off")
    assert (profile.guards.reward_collapse_steps, profile.guards.short_run) == ("off", "off")
    assert resolve_profile("tiny", "cpu").guards.rollout_mismatch == 1e-4  # fp32 on a CPU (profiles/devices/cpu.yaml)
    assert resolve_profile("tiny", "gpu").guards.rollout_mismatch == 0.05
    for bad in ("guards.rollout_mismatch=true", "guards.rollout_mismatch=-1", "guards.non_finite=warn",
                "guards.reward_collapse_steps=0"):
        with pytest.raises(ProfileError, match=r"guards\."):
            resolve_profile("tiny", "cpu", overrides=[bad])
    # A threshold's bad value in one line of the project's words, not pydantic's union parts in two.
    for bad, said in (("guards.rollout_mismatch=abc", "expects a number greater than 0 (a KL per token) or off, not 'abc'"),
                      ("guards.reward_collapse_steps=-3", "expects a whole number of steps from 1 to 1048576 or off, not -3"),
                      ("guards.reward_collapse_steps=2.5", "expects a whole number of steps from 1 to 1048576 or off")):
        with pytest.raises(ProfileError) as refused:
            resolve_profile("tiny", "cpu", overrides=[bad])
        assert said in str(refused.value) and "more below" not in str(refused.value)
        assert "constrained" not in str(refused.value) and "literal" not in str(refused.value)
    assert resolve_profile("tiny", "cpu", overrides=["guards.reward_collapse_steps=4"]).guards.reward_collapse_steps == 4


def test_a_non_finite_value_survives_the_runs_records(tmp_path):
    """Written as null it would read back as unmeasured (or drop the step)."""
    path = tmp_path / RunFolder.METRICS
    append_metrics(path, step(1, loss=math.nan, grad_norm=math.inf))
    (back,) = read_metrics(path)
    assert math.isnan(back.loss) and back.grad_norm == math.inf


def _verl_line(n: int, **data) -> bytes:
    """A training step's record as verl 0.9.1's file logger writes it (orjson, numpy values, NaN as null)."""
    record = {"training/global_step": n, "critic/score/mean": np.float64(0.4), "critic/score/max": 1.0,
              "critic/score/min": 0.0, "critic/advantages/max": np.float64(1.1), "critic/advantages/min": np.float64(-0.9),
              "actor/pg_loss": np.float64(-0.01), "actor/grad_norm": np.float64(0.3), "actor/entropy": np.float64(1.2),
              "rollout_corr/k3_kl": np.float64(4e-4), "rollout_corr/training_log_ppl": np.float64(1.3),
              "timing_s/step": 2.0, "response_length/mean": 10.0, **data}
    return orjson.dumps({"step": n, "data": record}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def test_verls_own_metrics_are_what_the_guards_read(tmp_path):
    path = tmp_path / "metrics-verl.jsonl"
    path.write_bytes(b"".join([
        orjson.dumps({"step": 0, "data": {"val-core/arith/reward/mean@1": 0.1}}) + b"\n",  # validation: no step
        _verl_line(1),
        _verl_line(2, **{"rollout_corr/k3_kl": np.float64(0.3)}),
        _verl_line(3, **{"critic/score/max": 0.0, "critic/score/min": 0.0, "critic/score/mean": 0.0}),
        _verl_line(4, **{"critic/advantages/max": 0.0, "critic/advantages/min": -0.0}),
        _verl_line(5, **{"actor/pg_loss": np.float64("nan"), "actor/grad_norm": np.float64("inf")}),
        _verl_line(6, **{"critic/score/mean": np.float64("nan")}),
        _verl_line(7, **{"rollout_corr/training_log_ppl": np.float64("nan")}),
        _verl_line(6),  # logged again
    ]))
    records = VerlMetrics(path, None, 32, None).new()
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6, 7, 6]
    first = records[0]
    assert (first.mismatch, first.grad_norm, first.zero_advantage_share) == (4e-4, 0.3, None)
    assert records[1].mismatch == 0.3
    assert records[2].zero_advantage_share == records[3].zero_advantage_share == 1.0
    assert math.isnan(records[4].loss) and math.isnan(records[4].grad_norm)  # null: NaN or infinity, not "absent"
    assert math.isnan(records[5].reward_mean) and math.isnan(records[6].mismatch)
    trip = run(StepGuards(GuardsSection()), records)
    assert (trip.guard, trip.step) == ("non_finite", 5) and "loss nan, grad norm nan" in trip.line
    # Records the run already has are skipped, past them every one comes, a repeat included.
    assert [r.step for r in VerlMetrics(path, 5, 32, 2).new()] == [6, 7, 6]


def test_verls_step_count_is_read_from_its_log_line():
    assert total_steps("\x1b[36m(TaskRunnerV1 pid=3)\x1b[0m INFO:2026-01-01 10:00:00,1:Total training steps: 12") == 12
    assert total_steps("(TaskRunnerV1 pid=3) INFO:2026:Total training steps: 12 ") == 12
    assert total_steps("step:3 - Total training steps: x") is None


def test_verl_resumes_only_with_its_dataloader_state_and_never_from_a_poisoned_step(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (2, 4, 6):
        (checkpoints / f"global_step_{n}").mkdir(parents=True)
        (checkpoints / f"global_step_{n}" / "data.pt").write_bytes(b"state")
    (checkpoints / TRACKER).write_text("6")
    (checkpoints / "global_step_4" / "data.pt").unlink()
    (checkpoints / "global_step_6" / "data.pt").write_bytes(b"")
    assert missing_dataloader_state(checkpoints, 2) is None
    assert "no dataloader state (data.pt)" in missing_dataloader_state(checkpoints, 4)
    assert "is empty" in missing_dataloader_state(checkpoints, 6)
    # NaN at step 5: verl had saved step 6 when the flow read step 5's metrics? No: it saved 4 and 6 before.
    kept = keep_good_checkpoint(checkpoints, GuardTrip(guard="non_finite", step=5, line="x"))
    assert kept == "checkpoint global_step_4; poisoned-global_step_6 set aside (saved from the poisoned step on)"
    assert tracker_step(checkpoints) == 4 and (checkpoints / "poisoned-global_step_6" / "data.pt").is_file()
    # another guard keeps the latest; a NaN before every checkpoint leaves none where a resume would look
    assert keep_good_checkpoint(checkpoints, GuardTrip(guard="rollout_mismatch", step=5, line="x")) == (
        "checkpoint global_step_4, the latest")
    kept = keep_good_checkpoint(checkpoints, GuardTrip(guard="non_finite", step=1, line="x"))
    assert kept.startswith("no checkpoint from before it; ") and tracker_step(checkpoints) is None
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "poisoned-global_step_2", "poisoned-global_step_4", "poisoned-global_step_6", f"poisoned-{TRACKER}"]


def test_a_local_checkpoint_resumes_only_with_the_trainer_state_of_its_step(tmp_path):
    folder = tmp_path / "global_step_4"
    folder.mkdir()
    assert missing_data_position(tmp_path, 4) == "it has no trainer_state.json"
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert missing_data_position(tmp_path, 4) == "its trainer_state.json says step 2"
    (folder / "trainer_state.json").write_text("{not json")
    assert "its trainer_state.json cannot be read" in missing_data_position(tmp_path, 4)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4, "epoch": 1.0}))
    assert missing_data_position(tmp_path, 4) is None


def test_each_epochs_order_is_a_function_of_the_epoch_so_a_resume_sees_the_uninterrupted_runs_batches():
    from trl.trainer.utils import RepeatSampler

    from grpo_pipeline.backends.local.data_order import EpochSeededSampler

    rows = list(range(24))
    options = dict(mini_repeat_count=2, batch_size=4, repeat_count=1, shuffle=True, seed=7)
    uninterrupted = EpochSeededSampler(rows, **options)
    orders = []
    for epoch in range(3):
        uninterrupted.set_epoch(epoch)
        orders.append(list(uninterrupted))
    assert orders[0] == list(RepeatSampler(rows, **options))  # the first epoch is TRL's own order
    assert orders[0] != orders[1] != orders[2]
    for epoch in range(3):  # a run resumed in this epoch builds a fresh sampler
        resumed = EpochSeededSampler(rows, **options)
        resumed.set_epoch(epoch)
        assert list(resumed) == orders[epoch]
    # TRL's own sampler, resumed in the second epoch, replays the first: the bug this fixes
    fresh = RepeatSampler(rows, **options)
    assert list(fresh) == orders[0] != orders[1]


def test_the_probe_sees_a_rollout_engine_left_on_older_weights(tiny_model_dir):
    """The generate path's log-probs (SampledLogProbs) against the trainer's pass: ~0 with the same weights,
    far above the CPU threshold once the trainer's weights moved and the rollout's did not."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from grpo_pipeline.backends.local.probe import SampledLogProbs, k3_mismatch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = torch.randint(5, 400, (3, 12), generator=torch.Generator().manual_seed(0))
    recording = SampledLogProbs(2, temperature=0.8)
    torch.manual_seed(0)
    out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=0.8,
                         max_new_tokens=10, min_new_tokens=10, logits_processor=LogitsProcessorList([recording]),
                         pad_token_id=0)
    recording.finish(out)
    sampled = torch.tensor(recording.logprobs)
    assert sampled.shape == (2, 10)

    def trainer_logprobs():
        with torch.no_grad():
            logits = model(out[:2]).logits[:, prompts.size(1) - 1:-1].float() / 0.8
        return torch.log_softmax(logits, -1).gather(2, out[:2, prompts.size(1):, None]).squeeze(2)

    mask = torch.ones_like(sampled)
    # Not 0: min_new_tokens bans end-of-sequence while sampling, which moves that mass (the native decoder
    # does the same); two orders of magnitude below the CPU threshold all the same.
    assert k3_mismatch(trainer_logprobs(), sampled, mask) < 1e-5
    with torch.no_grad():  # a training step the rollout engine never saw
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    assert k3_mismatch(trainer_logprobs(), sampled, mask) > 1e-3
    nan = sampled.clone()
    nan[0, 3] = math.nan
    assert math.isnan(k3_mismatch(trainer_logprobs(), nan, mask))


def test_the_reports_panel_shows_the_guards_numbers_and_which_stopped_the_run(tmp_path):
    for n in range(1, 6):
        append_metrics(tmp_path / RunFolder.METRICS, step(n, mismatch=10.0 ** -n, zero_advantage_share=n / 5,
                                                grad_norm=math.nan if n == 5 else 0.3))
    trip = GuardTrip(guard="non_finite", step=5, line="step 5: non-finite grad norm nan", kept="checkpoint global_step_4")
    (tmp_path / RunFolder.GUARDS).write_text(trip.model_dump_json())
    profile = {"guards": GuardsSection().model_dump(mode="json")}
    guard_panel.draw(tmp_path, read_metrics(tmp_path / RunFolder.METRICS), profile)
    assert (tmp_path / RunFolder.GUARDS_PLOT).read_bytes().startswith(b"\x89PNG")
    lines = guard_panel.section(tmp_path, lambda name, alt: f"![{alt}]({name})", profile)
    assert lines[0] == "## Guards"
    assert ("**Stopped by the `non_finite` guard**: step 5: non-finite grad norm nan. Kept: checkpoint global_step_4."
            in lines)
    assert "At step 5: rollout vs trainer mismatch 1e-05, zero-advantage groups 1, gradient norm nan." in lines
    assert "![guards](guards.png)" in lines
    assert guard_panel.section(tmp_path / "empty", str, profile) == []


def test_a_non_finite_reward_stops_training_through_the_guard(tmp_path):
    """Issue 55: a user's reward returning NaN stopped the run as RewardError (exit 2) through no guard: no
    guards.json, no panel. In the worker's reward it is now the non_finite guard's trip, at the step its
    rollouts were scored for, naming the reward and the row; with the guard off, the reward's own error."""
    from types import SimpleNamespace

    from grpo_pipeline.backends.local.rewards import trl_rewards
    from grpo_pipeline.rewards.functions import NonFiniteReward
    from grpo_pipeline.rewards.plan import FunctionEntry, RewardPlan

    reward = tmp_path / "nan.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float('nan') if extra_info['index'] == 1 else 1.0\n")
    plan = RewardPlan(functions=[FunctionEntry(spec=f"{reward}:compute_score")])
    call = dict(prompts=["p0", "p1"], completions=["a", "b"], data_source=["arith"] * 2, ground_truth=["1", "2"],
                extra_info=[{"index": 0, "split": "train"}, {"index": 1, "split": "train"}],
                trainer_state=SimpleNamespace(global_step=4))
    (function,), _ = trl_rewards(plan, GuardsSection())
    with pytest.raises(GuardTripped) as tripped:
        function(**call)
    assert (tripped.value.trip.guard, tripped.value.trip.step) == ("non_finite", 5)
    assert tripped.value.trip.line.startswith("step 5: non-finite reward: reward compute_score returned nan is not a "
                                              "finite number for row 1 of the train split")
    assert tripped.value.trip.line.endswith("(guards.non_finite=off to run on)")
    (function,), _ = trl_rewards(plan, GuardsSection(non_finite="off"))
    with pytest.raises(NonFiniteReward, match="row 1 of the train split"):
        function(**call)
