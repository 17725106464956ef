"""Rewards users bring, verl-style and TRL-style, with weights, extras, a reward server on 127.0.0.1 and its
faults, and the planning check (a child process that imports them and calls them on two rows)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reward_files import RAISES_ON_ONE, TRL_STYLE, VERL_STYLE, write
from reward_server import RewardServer
from grpo_pipeline.data.rl_data import RL_SCHEMA, rl_row
from grpo_pipeline.rewards.check import check_rewards
from grpo_pipeline.rewards.functions import RewardError, UserReward
from grpo_pipeline.rewards.plan import FunctionEntry, RewardParts, RewardPlan, batch_of
from grpo_pipeline.rewards.server import RewardServerDown

ROWS = [rl_row("arith", f"What is {n}+{n}?", str(2 * n), "train", n, str(2 * n), f"{n}+{n}") for n in range(4)]
TEXTS = ["12", "abc", "4 apples", "the answer is 6"]


def batch():
    return batch_of([dict(row) for row in ROWS], TEXTS)


def test_a_verl_reward_and_a_trl_reward_unchanged_weighted_with_extras(tmp_path):
    plan = RewardPlan(functions=[FunctionEntry(spec=write(tmp_path, "v.py", VERL_STYLE) + ":compute_score", weight=0.5),
                                 FunctionEntry(spec=write(tmp_path, "t.py", TRL_STYLE) + ":digit_share")])
    parts = RewardParts(plan)
    assert [(p.name, p.weight, p.score.style) for p in parts.parts] == [("compute_score", 0.5, "verl"), ("digit_share", 1.0, "trl")]
    scores = parts.score(batch())
    share = [1.0, 0.0, 1 / 8, 1 / 15]
    assert scores.parts["compute_score"] == pytest.approx(share) and scores.parts["digit_share"] == pytest.approx(share)
    assert scores.rewards == pytest.approx([1.5 * s for s in share])
    assert scores.extras["acc"] == [0.0, 0.0, 1.0, 1.0] and scores.extras["length"] == [2.0, 3.0, 8.0, 15.0]
    assert scores.means()["reward_extras/acc/mean"] == 0.5 and "rewards/digit_share/mean" in scores.means()


def test_rewards_of_one_name_are_each_counted_once(tmp_path):
    """Issue 55: `x, x, x_1` became `x_0, x_1, x_1`: one part dropped, another counted twice (2.0, not 1.5)."""
    spec = write(tmp_path, "v.py", VERL_STYLE) + ":compute_score"
    plan = RewardPlan(functions=[FunctionEntry(spec=spec, weight=0.5, name="x"), FunctionEntry(spec=spec, weight=0.5, name="x"),
                                 FunctionEntry(spec=spec, weight=0.5, name="x_1")])
    parts = RewardParts(plan)
    assert [p.name for p in parts.parts] == ["x_2", "x_3", "x_1"]
    scores = parts.score(batch())
    share = [1.0, 0.0, 1 / 8, 1 / 15]
    assert set(scores.parts) == {"x_1", "x_2", "x_3"} and scores.rewards == pytest.approx([1.5 * s for s in share])


@pytest.mark.parametrize("weights", [["0"], ["-1", "-0.5"]])
def test_rewards_without_a_positive_weight_are_refused_at_planning(tmp_path, weights):
    """Issue 55: with no positive weight full marks were 0, so every response of a random model counted as correct."""
    from grpo_pipeline.errors import ProfileError
    from grpo_pipeline.stages.plan import resolve_profile

    spec = write(tmp_path, "v.py", VERL_STYLE) + ":compute_score"
    functions = ", ".join(f"{{path: {spec}, weight: {w}}}" for w in weights)
    with pytest.raises(ProfileError, match="no reward has a weight above 0"):
        resolve_profile("tiny", "cpu", overrides=[f"reward.functions=[{functions}]"])


def test_a_reward_that_raises_on_one_sample_names_its_row(tmp_path):
    reward = UserReward(write(tmp_path, "r.py", RAISES_ON_ONE) + ":compute_score")
    # Issue 56: the user's own line to fix, once, without the traceback
    with pytest.raises(RewardError, match=r"reward compute_score \(.*r.py:compute_score\) raised on row 1 of the train "
                                          r"split at r.py:4: ValueError: cannot parse this one"):
        reward(batch())


@pytest.mark.parametrize(("source", "fragment"), [
    ("def f(text):\n    return 1.0\n", r"takes \(text\); write verl's compute_score\(data_source, solution_str, ground_truth"),
    ("import not_a_module_anywhere\ndef f(prompts, completions, **kw):\n    return []\n",
     "importing .* failed: ModuleNotFoundError"),
])
def test_a_reward_that_cannot_be_used_is_one_line(tmp_path, source, fragment):
    with pytest.raises(RewardError, match=fragment):
        UserReward(write(tmp_path, "bad.py", source) + ":f")


@pytest.mark.e2e  # starts a reward server on 127.0.0.1
def test_a_reward_server_scores_batches_with_its_token(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "s3cret-token-value")
    with RewardServer(token="s3cret-token-value") as server:
        plan = RewardPlan(url=server.url, token="${REWARD_TOKEN}", batch_size=3, retries=0)
        scores = RewardParts(plan).score(batch())
        assert scores.parts["server"] == pytest.approx([1.0, 0.0, 1 / 8, 1 / 15])
        assert [len(b["completions"]) for b in server.batches] == [3, 1]  # batched JSON requests
        assert server.batches[0]["ground_truth"] == ["0", "2", "4"] and server.batches[0]["data_source"] == ["arith"] * 3


@pytest.mark.e2e  # starts a reward server on 127.0.0.1
@pytest.mark.parametrize(("fault", "error", "fragment"), [
    ("count", RewardError, "answered 2 rewards for 3 completions (the batch of row 0 of the train split..row 2 of the "
                           "train split); it must answer one per completion"),
    ("text", RewardError, "answered 'high' for row 0 of the train split: a reward is a number or null"),
    ("500", RewardServerDown, "failed 3 times for the batch of row 0 of the train split..row 2 of the train split: HTTP 500"),
])
def test_a_reward_servers_faults_are_each_one_line(fault, error, fragment):
    with RewardServer() as server:
        server.misbehave(fault)
        with pytest.raises(error) as raised:
            RewardParts(RewardPlan(url=server.url, batch_size=3, retries=2, timeout_s=5)).score(batch())
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.e2e  # starts a reward server on 127.0.0.1
def test_a_server_that_fails_twice_is_retried_and_a_killed_one_stops_the_run_in_one_line():
    with RewardServer() as server:
        server.misbehave("500", times=2)
        plan = RewardPlan(url=server.url, retries=2, timeout_s=5)
        assert len(RewardParts(plan).score(batch()).rewards) == 4
        url = server.url
    with pytest.raises(RewardServerDown, match=r"reward server http://127.0.0.1:\d+/score failed 3 times .*ConnectError"):
        RewardParts(RewardPlan(url=url, retries=2, timeout_s=5)).score(batch())


@pytest.mark.e2e  # starts a reward server on 127.0.0.1
def test_a_wrong_token_is_refused_at_once_without_showing_it(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "wrong-token-value")
    with RewardServer(token="right-token") as server:
        with pytest.raises(RewardError) as raised:
            RewardParts(RewardPlan(url=server.url, token="${REWARD_TOKEN}", retries=3)).score(batch())
    assert "HTTP 401" in str(raised.value) and "wrong-token-value" not in str(raised.value)


@pytest.mark.e2e  # the planning check calls the reward in a subprocess
def test_the_planning_check_imports_checks_columns_and_calls_two_rows(tmp_path):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS, schema=RL_SCHEMA), data)
    verl_file, trl_file = write(tmp_path, "v.py", VERL_STYLE), write(tmp_path, "t.py", TRL_STYLE)
    plan = RewardPlan(functions=[FunctionEntry(spec=f"{verl_file}:compute_score"), FunctionEntry(spec=f"{trl_file}:digit_share")])
    lines = check_rewards(plan, str(data), timeout_s=120)
    assert lines == ["reward compute_score (verl style, weight 1): 1, 1 on 2 rows; extras acc, length",
                     "reward digit_share (trl style, weight 1): 1, 1 on 2 rows"]
    asks = write(tmp_path, "asks.py", "def f(prompts, completions, solution, **kw):\n    return [1.0] * len(prompts)\n")
    with pytest.raises(RewardError, match="reward f asks for column\\(s\\) solution, which .* does not have"):
        check_rewards(RewardPlan(functions=[FunctionEntry(spec=f"{asks}:f")]), str(data), timeout_s=120)
    exits = write(tmp_path, "exits.py", "import os\nos._exit(3)\n")
    with pytest.raises(RewardError, match="the reward check's process ended \\(exit 3\\) before it answered"):
        check_rewards(RewardPlan(functions=[FunctionEntry(spec=f"{exits}:f")]), str(data), timeout_s=120)


def test_names_every_tracker_takes(tmp_path):
    """Issue 55: a reward named `acc!` (or an extra keyed so) lost every training step from MLflow, which refuses
    the metric's name; a part's name is refused at planning, an extra's key is mapped."""
    from grpo_pipeline.errors import ProfileError
    from grpo_pipeline.rewards.plan import BatchScores
    from grpo_pipeline.stages.plan import resolve_profile

    spec = write(tmp_path, "v.py", VERL_STYLE) + ":compute_score"
    with pytest.raises(ProfileError, match=r"'acc!' names the metric rewards/acc!/mean, which trackers refuse"):
        resolve_profile("tiny", "cpu", overrides=[f"reward.functions=[{{path: {spec}, name: 'acc!'}}]"])
    assert resolve_profile("tiny", "cpu", overrides=[f"reward.functions=[{{path: {spec}, name: acc-1.b}}]"])
    scores = BatchScores(rewards=[1.0], parts={"x": [1.0]}, extras={"acc!": [1.0], "pass@1 (strict)": [0.0]})
    assert set(scores.means()) == {"rewards/x/mean", "reward_extras/acc_/mean", "reward_extras/pass_1__strict_/mean"}


def test_a_bearer_token_never_crosses_the_network_in_clear(monkeypatch):
    """Issue 55: reward.token was sent over plain http to any host without a word."""
    from grpo_pipeline.errors import ProfileError
    from grpo_pipeline.stages.plan import resolve_profile

    monkeypatch.setenv("REWARD_TOKEN", "tok-1234567890")
    token = "reward.token=${REWARD_TOKEN}"
    with pytest.raises(ProfileError, match="would cross the network unencrypted over http://; use https://"):
        resolve_profile("tiny", "cpu", overrides=["reward.url=http://scorer.example:8000/score", token])
    for url in ("https://scorer.example/score", "http://127.0.0.1:8000/score", "http://localhost/score"):
        assert resolve_profile("tiny", "cpu", overrides=[f"reward.url={url}", token]).reward.url == url


def test_late_failures_planning_can_catch_are_refused_at_planning(tmp_path, monkeypatch):
    """Issue 55: a relative reward path failed in the workers 91 s in; a negative seed after generation, retried."""
    from grpo_pipeline.errors import ProfileError
    from grpo_pipeline.stages.plan import resolve_profile

    write(tmp_path, "v.py", VERL_STYLE)
    monkeypatch.chdir(tmp_path)
    (function,) = resolve_profile("tiny", "cpu", overrides=["reward.functions=[v.py:compute_score]"]).reward.functions
    assert function.path == f"{tmp_path / 'v.py'}:compute_score"  # the planning directory's, wherever workers run
    for seed in ("data.seed=-1", "eval.seed=-5", f"data.seed={2**32}"):
        with pytest.raises(ProfileError, match=seed.split("=")[0]):
            resolve_profile("tiny", "cpu", overrides=[seed])
