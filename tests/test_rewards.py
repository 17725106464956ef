"""The reward functions on hand-written responses, malformed ones included."""

from __future__ import annotations

import pytest

from grpo_pipeline.errors import UserError
from grpo_pipeline.rewards.builtin import arith_score, boxed_content, geo3k_score, gsm8k_score, score


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


def test_the_data_source_picks_the_reward_and_an_unknown_one_is_refused():
    assert score("openai/gsm8k", "#### 3", "3").reward == 1.0
    assert score("arith", "3", "3").reward == 1.0
    assert score("HuggingFaceH4/MATH-500", "so \\boxed{\\frac{1}{2}}", "0.5").reward == 1.0
    with pytest.raises(UserError, match="no reward function for data_source 'lighteval/MATH'"):
        score("lighteval/MATH", "3", "3")


GSM8K_RESPONSES = [case[:2] for case in test_gsm8k_strict.pytestmark[0].args[1]]
GEO3K_RESPONSES = [case[:2] for case in test_geo3k_accuracy_and_format.pytestmark[0].args[1]]


def test_gsm8k_and_geo3k_keep_verls_own_scores_on_the_same_responses():
    """verl 0.9.1's own scorers (the wheel `make setup` installs), on every response above."""
    from verl.utils.reward_score import geo3k, gsm8k

    for response, truth in GSM8K_RESPONSES:
        assert gsm8k_score(response, truth).reward == gsm8k.compute_score(response, truth), response
    for response, truth in GEO3K_RESPONSES:
        assert geo3k_score(response, truth).reward == pytest.approx(geo3k.compute_score(response, truth)), response


@pytest.mark.parametrize(
    "response, truth, correct",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
        ("The answer is 0.5", "\\frac12", True),  # graded, not string-compared
        ("Answer: 42", "42", True),  # DAPO's answer line
        ("$\\boxed{\\dfrac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt3}{2}", True),
        ("x \\in \\boxed{[2,5)}", "[2,5)", True),
        ("\\boxed{3}", "4", False),
        ("no answer at all", "7", False),
        ("", "7", False),
    ],
)
def test_math_answers_are_graded_by_math_verify(response, truth, correct):
    result = score("HuggingFaceH4/MATH-500", response, truth)
    assert (result.correct, result.reward) == (correct, float(correct))
