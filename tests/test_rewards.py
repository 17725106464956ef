"""The reward functions on hand-written responses, malformed ones included."""

from __future__ import annotations

import pytest

from grpo_pipeline.common.errors import UserError
from grpo_pipeline.common.rewards import arith_score, boxed_content, geo3k_score, gsm8k_score, score


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas are removed
        ("#### $5", "5", 0.0),  # the regex takes digits only: "$5" never matches "#### ("
        ("#### 70\nNo wait.\n#### 72", "72", 1.0),  # the last one counts
        ("#### 72\nNo wait.\n#### 70", "72", 0.0),
        ("The answer is 72.", "72", 0.0),  # strict: no ####, no credit
        ("####72", "72", 0.0),  # a space is required
        ("#### 72" + "x" * 300, "72", 0.0),  # outside the final 300 characters
        ("x" * 1000 + "#### 72", "72", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 72.0", "72", 0.0),  # string equality, as verl's gsm8k
        ("", "72", 0.0),
    ],
)
def test_gsm8k_strict(response, truth, reward):
    assert gsm8k_score(response, truth).reward == reward


@pytest.mark.parametrize(
    "response, truth, reward, correct, formatted",
    [
        ("<think>angles sum to 180</think> so x = \\boxed{60}", "60", 1.0, True, True),
        ("<think>hmm</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0, True, True),  # graded, not string-compared
        ("x = \\boxed{60}", "60", 0.9, True, False),  # right, without the think block
        ("<think>x</think> \\boxed{59}", "60", 0.1, False, True),
        ("<think>x</think> the answer is 60", "60", 0.0, False, False),
        ("<think>unclosed \\boxed{60", "60", 0.0, False, False),
        ("", "60", 0.0, False, False),
    ],
)
def test_geo3k_accuracy_and_format(response, truth, reward, correct, formatted):
    result = geo3k_score(response, truth)
    assert (result.reward, result.correct, result.formatted) == (pytest.approx(reward), correct, formatted)


def test_boxed_content_balances_braces():
    assert boxed_content("\\boxed{1} then \\boxed{\\sqrt{3}}") == "\\sqrt{3}"
    assert boxed_content("no box") is None and boxed_content("\\boxed{open") is None


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("19", "19", 1.0),
        (" 19\n", "19", 1.0),
        ("12 + 7 = 19", "19", 0.9),  # correct, but not the bare number asked for
        ("12 + 7 = 9", "19", 0.0),
        ("9", "19", 0.1),  # the right form, the wrong number
        ("-4", "-4", 1.0),
        ("nineteen", "19", 0.0),
        ("", "19", 0.0),
    ],
)
def test_arith(response, truth, reward):
    assert arith_score(response, truth).reward == pytest.approx(reward)


def test_the_data_source_picks_the_reward_and_an_unknown_one_is_refused(tmp_path):
    assert score("openai/gsm8k", "#### 3", "3").reward == 1.0
    assert score("arith", "3", "3").reward == 1.0
    with pytest.raises(UserError, match="no reward function for data_source 'lighteval/MATH'"):
        score("lighteval/MATH", "3", "3")
    custom = tmp_path / "reward.py"
    custom.write_text("def half(response, ground_truth):\n    return 0.5\n")
    assert score("anything", "x", "y", f"{custom}:half").reward == 0.5
    with pytest.raises(UserError, match="has no function 'whole'"):
        score("anything", "x", "y", f"{custom}:whole")
