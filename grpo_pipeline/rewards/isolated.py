"""Scoring with a user's reward in a child process, for the stages that score in the flow's own process.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/r.py:compute_score]'

The evaluation stage scores every sample with the run's reward; a user's function that calls `os._exit(0)`
or `sys.exit(0)` ended the flow with exit code 0, no error line, no report and the tracker's run left
running. Here the user's code runs in a child (as rewards/check.py's check does): whatever way it ends
the child, the reward has failed, in one line naming how. The built-in reward is the project's own code
and is scored in place.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from grpo_pipeline.rewards import child
from grpo_pipeline.rewards.functions import RewardError
from grpo_pipeline.rewards.plan import BatchScores, RewardParts, RewardPlan, batch_of


def score_rows(plan: RewardPlan, rows: list[dict[str, Any]], completions: list[str]) -> BatchScores:
    """The rows' completions scored with the plan's parts: in a child process when the user brought them."""
    if not plan.custom:
        return RewardParts(plan).score(batch_of(rows, completions))
    request = {"plan": plan.model_dump(mode="json"), "rows": [_plain(row) for row in rows], "completions": completions}
    answer = child.ask("grpo_pipeline.rewards.isolated", request, plan.eval_timeout_s,
                       timed_out=f"scoring {len(completions)} responses with the run's reward did not end within "
                                 f"{plan.eval_timeout_s:g} s (reward.eval_timeout_s): a reward that hangs, or a server "
                                 "that does not answer; fix it or raise the limit",
                       ended="the reward's process ended (exit {code}) before it returned its scores: {said}; a reward "
                             "must return its values, never exit the process", silent="nothing on stderr")
    return BatchScores(**answer["scores"])


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A row as JSON carries it (images are the model's input, never a reward's)."""
    return {key: value for key, value in row.items() if key != "images"}


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        scores = RewardParts(RewardPlan.model_validate(request["plan"])).score(
            batch_of(request["rows"], request["completions"]))
        answer = {"scores": dataclasses.asdict(scores)}
    except RewardError as exc:
        answer = {"error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward is its failure, told in one line
        answer = {"error": f"a reward ended with {type(exc).__name__}: {str(exc)[:300]}"}
    child.answer(answer)


if __name__ == "__main__":
    main()
