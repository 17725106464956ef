"""Reward functions, one implementation for training (both backends' semantics) and evaluation.

A row's `data_source` picks the function; each returns a `Score` whose `reward` is what GRPO
optimises and whose `correct` / `formatted` flags feed evaluation metrics (accuracy, format rate).

- `openai/gsm8k` (verl's `reward_score/gsm8k.py`, strict method): 1.0 when the last `#### <number>` in the
  final 300 characters equals the ground truth (commas and `$` removed), else 0.
- `hiyouga/geometry3k`: 0.9 x accuracy + 0.1 x format. Accuracy: the last `\\boxed{...}` grades equal
  to the ground truth (mathruler's grader); format: the whole response matches
  `<think>.*</think>.*\\boxed{.*}.*`.
- `arith`: 0.9 x correct + 0.1 x format. Correct: the last integer in the response equals the
  answer; format: the response is a bare integer, as the prompt asks.

A custom reward (`algorithm.reward_function: /path/file.py:function`) is a function
`(response: str, ground_truth: str) -> float` that replaces these for every row.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from grpo_pipeline.common.errors import UserError


class Score(BaseModel):
    reward: float
    correct: bool
    formatted: bool


# Every built-in reward lies in [0, 1] (a custom reward function's range is its own): the report's band
# around the mean reward stays inside it.
BUILTIN_REWARD_RANGE = (0.0, 1.0)
GSM8K_CLIP_CHARS = 300
_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")
_BARE_INTEGER = re.compile(r"\s*-?\d+\s*")


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


def arith_score(response: str, ground_truth: str) -> Score:
    numbers = _INTEGER.findall(response)
    correct = bool(numbers) and numbers[-1] == ground_truth.strip()
    formatted = _BARE_INTEGER.fullmatch(response) is not None
    return Score(reward=0.9 * correct + 0.1 * formatted, correct=correct, formatted=formatted)


REWARDS: dict[str, Callable[[str, str], Score]] = {
    "openai/gsm8k": gsm8k_score,
    "hiyouga/geometry3k": geo3k_score,
    "arith": arith_score,
}


@cache
def custom_reward(spec: str) -> Callable[[str, str], float]:
    """`/path/to/file.py:function`, loaded from the file (a path every node can read)."""
    path, _, name = spec.rpartition(":")
    if not path or not name or not Path(path).is_file():
        raise UserError(f"algorithm.reward_function={spec!r}: expected /path/to/file.py:function of an existing file")
    module_spec = importlib.util.spec_from_file_location(f"grpo_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"algorithm.reward_function={spec!r}: {path} has no function {name!r}")
    return function


def score(data_source: str, response: str, ground_truth: str, reward_function: str | None = None) -> Score:
    if reward_function:
        value = float(custom_reward(reward_function)(response, ground_truth))
        return Score(reward=value, correct=value >= 1.0, formatted=value > 0.0)
    try:
        return REWARDS[data_source](response, ground_truth)
    except KeyError:
        raise UserError(
            f"no reward function for data_source {data_source!r}; known: {', '.join(REWARDS)} "
            "(or set algorithm.reward_function=/path/file.py:function)"
        ) from None
