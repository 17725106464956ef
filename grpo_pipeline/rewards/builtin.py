"""The built-in rewards, one implementation for training (both backends) and evaluation, picked by a
row's `data_source`.

    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=math500 --stages fetch_dataset,evaluate

Each returns a `Score` whose `reward` is what GRPO optimises and whose `correct` / `formatted` flags feed
evaluation metrics (accuracy, format rate, pass@k).

- `openai/gsm8k`: verl's `reward_score/gsm8k.py` (strict): 1.0 when the last `#### <number>` in the final
  300 characters equals the ground truth (commas and `$` removed), else 0 (tests/test_rewards.py checks it
  against verl's own function on the same responses).
- `hiyouga/geometry3k`: verl's `reward_score/geo3k.py`: 0.9 x accuracy + 0.1 x format. Accuracy: the last
  `\\boxed{...}` grades equal to the ground truth (mathruler's grader); format: the whole response matches
  `<think>.*</think>.*\\boxed{.*}.*`.
- MATH, MATH-500, DAPO-Math-17k, AIME (`MATH_SOURCES`): 1.0 when math-verify (the grader TRL's and
  open-r1's accuracy rewards use) finds the response's answer equal to the ground truth, else 0; as verl's
  optional `reward_score/math_verify.py` calls it: the ground truth read as `\\boxed{<truth>}`, the
  response's last LaTeX or plain expression. Formatted: the response has a `\\boxed{}` or an `Answer:` line.
- `arith`: 0.9 x correct + 0.1 x format. Correct: the last integer in the response equals the answer;
  format: the response is a bare integer, as the prompt asks.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from pydantic import BaseModel

from grpo_pipeline.errors import UserError


class Score(BaseModel):
    reward: float
    correct: bool
    formatted: bool


# Every built-in reward lies in [0, 1] (a user's reward function's range is its own): the report's band
# around the mean reward stays inside it.
BUILTIN_REWARD_RANGE = (0.0, 1.0)
GSM8K_CLIP_CHARS = 300
_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")
_BARE_INTEGER = re.compile(r"\s*-?\d+\s*")
_ANSWER_LINE = re.compile(r"(?im)^\s*answer\s*:")
# A response's answer is at its end; math-verify reads the whole text, so very long rambles are cut.
MATH_CLIP_CHARS = 4000
MATH_VERIFY_TIMEOUT_S = 5


def gsm8k_score(response: str, ground_truth: str) -> Score:
    found = _GSM8K_FINAL.findall(response[-GSM8K_CLIP_CHARS:])
    if not found:
        return Score(reward=0.0, correct=False, formatted=False)
    correct = found[-1].replace(",", "").replace("$", "") == ground_truth
    return Score(reward=1.0 if correct else 0.0, correct=correct, formatted=True)


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, content = 0, text[start + len("\\boxed{") :]
    for index, char in enumerate(content):
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return content[:index].strip()
            depth -= 1
    return None


def geo3k_score(response: str, ground_truth: str) -> Score:
    from mathruler.grader import grade_answer

    answer = boxed_content(response)
    correct = answer is not None and bool(grade_answer(answer, ground_truth))
    formatted = _GEO3K_FORMAT.fullmatch(response) is not None
    return Score(reward=0.9 * correct + 0.1 * formatted, correct=correct, formatted=formatted)


def math_verify_equal(response: str, ground_truth: str) -> bool:
    """math-verify's verdict: the response's answer equals the ground truth (a LaTeX or plain answer).
    Its timeouts use SIGALRM, which works only in a main thread; elsewhere (Ray Train's worker thread,
    verl's reward threads) it runs without them, as math-verify documents."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", (LatexExtractionConfig(),), parsing_timeout=timeout)
    if not gold:  # a plain answer math-verify reads no LaTeX in (`3/4`, `x=2`)
        gold = parse(ground_truth, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout)
    answer = parse(response[-MATH_CLIP_CHARS:], (ExprExtractionConfig(), LatexExtractionConfig()),
                   parsing_timeout=timeout)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=timeout))


def math_score(response: str, ground_truth: str) -> Score:
    correct = math_verify_equal(response, ground_truth)
    formatted = "\\boxed{" in response or _ANSWER_LINE.search(response) is not None
    return Score(reward=1.0 if correct else 0.0, correct=correct, formatted=formatted)


def arith_score(response: str, ground_truth: str) -> Score:
    numbers = _INTEGER.findall(response)
    correct = bool(numbers) and numbers[-1] == ground_truth.strip()
    formatted = _BARE_INTEGER.fullmatch(response) is not None
    return Score(reward=0.9 * correct + 0.1 * formatted, correct=correct, formatted=formatted)


# The data sources of the math datasets (data/math_data.py writes them; verl's own names where verl has one).
MATH_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo", "aime24", "aime25")
# Data sources whose reward here is verl's own default reward, on the same responses: a verl run of them
# with no reward of the user's needs no reward of the pipeline's.
VERL_SAME = ("openai/gsm8k", "hiyouga/geometry3k")

REWARDS: dict[str, Callable[[str, str], Score]] = {
    "openai/gsm8k": gsm8k_score,
    "hiyouga/geometry3k": geo3k_score,
    "arith": arith_score,
    **{source: math_score for source in MATH_SOURCES},
}


def score(data_source: str, response: str, ground_truth: str) -> Score:
    try:
        return REWARDS[data_source](response, ground_truth)
    except KeyError:
        raise UserError(
            f"no reward function for data_source {data_source!r}; known: {', '.join(REWARDS)} "
            "(or bring one: reward.functions=[/path/file.py:function], or reward.url)"
        ) from None
