"""A user's reward run in a child process, and the child's one answer: the run's process stays whole whatever
the user's code does (hang, exit, crash its interpreter).

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/r.py:compute_score]' --dry-run

Used by the planning check (rewards/check.py) and evaluation's scoring (rewards/isolated.py): the request goes
in on stdin as JSON, the answer comes back as a marked stdout line (a reward may print anything, on any line),
`{"error": ...}` for the reward's own one-line failure.
"""

from __future__ import annotations

import json
import subprocess
import sys

from grpo_pipeline.rewards.functions import RewardError

_ANSWER = "@grpo-reward-answer@ "


def answer(payload: dict) -> None:
    """In the child: its one answer, on a line of its own."""
    print("\n" + _ANSWER + json.dumps(payload), flush=True)


def ask(module: str, request: dict, timeout_s: float, timed_out: str, ended: str, silent: str) -> dict:
    """`python -m module`'s answer to `request`. RewardError: `timed_out` past `timeout_s` (the child is killed),
    `ended` (formatted with the exit `code` and the last stderr line `said`, `silent` where it printed none) when
    the child ended without an answer, or the answer's own error."""
    try:
        done = subprocess.run([sys.executable, "-m", module], input=json.dumps(request), text=True,
                              capture_output=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RewardError(timed_out) from None
    found = next((json.loads(line[len(_ANSWER):]) for line in reversed(done.stdout.splitlines())
                  if line.startswith(_ANSWER)), None)
    if found is None:
        said = (done.stderr.strip().splitlines() or [silent])[-1][:300]
        raise RewardError(ended.format(code=done.returncode, said=said))
    if "error" in found:
        raise RewardError(found["error"])
    return found
