"""The checks a run's reward passes before anything expensive starts.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/r.py:compute_score]' --dry-run

- `reward_problems` (profiles/validation.py: every plan, the dry run's too; nothing of the user's runs): each
  file is there, is Python, and defines the function at its top level; the server's URL is http(s); its
  token a reference.
- `check_rewards` (when the data is there: planning when the dataset is already in the store, the train and
  evaluate stages before a worker starts or a job is submitted): in a child process, as a worker would, each
  file imports, each function has an accepted signature (rewards/functions.py), the columns a TRL reward asks
  for exist in the data, and every part called on two rows of the data returns numbers (a reward server
  included). A child process, because the user's code may hang, exit or crash its interpreter: the run's
  process stays whole, and the check ends after `reward.check_timeout_s`.
"""

from __future__ import annotations

import json
import sys

from grpo_pipeline.errors import UserError
from grpo_pipeline.rewards import child
from grpo_pipeline.rewards.functions import RewardError

DRY_ROWS = 2

def builtin_problems(files: list[str]) -> list[str]:
    """Without a reward of the user's: a built-in reward for every data_source of the data."""
    import pyarrow.parquet as pq

    from grpo_pipeline.rewards.builtin import REWARDS

    problems = []
    for path in files:
        sources = set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())
        if unknown := sorted(str(s) for s in sources - set(REWARDS)):
            problems.append(f"{path}: no built-in reward for data_source {', '.join(unknown)}; known: {', '.join(REWARDS)} "
                            "(or bring one: reward.functions=[/path/file.py:function], or reward.url)")
    return problems


def check_rewards(plan, data_file: str | None, timeout_s: float) -> list[str]:
    """One line per reward part (its style and its values on two rows), or RewardError in one line. With no data
    yet (`data_file` None) only the imports and signatures are checked."""
    if not plan.custom:
        problems = builtin_problems([data_file]) if data_file else []
        if problems:
            raise RewardError(problems[0])
        return []
    request = {"plan": plan.model_dump(mode="json"), "data_file": data_file}
    answer = child.ask("grpo_pipeline.rewards.check", request, timeout_s,
                       timed_out=f"the reward check (import, signature, a call on {DRY_ROWS} rows) did not end within "
                                 f"{timeout_s:g} s (reward.check_timeout_s): a reward that hangs, or a server that does "
                                 "not answer; fix it or raise the limit",
                       ended="the reward check's process ended (exit {code}) before it answered: {said}",
                       silent="no output")
    return answer["lines"]


def _check_here(plan_data: dict, data_file: str | None) -> list[str]:
    """In the child: load every part, then call it on two rows of the data."""
    from grpo_pipeline.rewards.functions import TRL_PARAMETERS, TRL_SUPPLIED, asked_columns
    from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, batch_of

    parts = RewardParts(RewardPlan.model_validate(plan_data))
    lines = []
    if data_file is None:
        return [f"reward {part.name}: {getattr(part.score, 'style', 'server')} style, loads" for part in parts.parts]
    import pyarrow.parquet as pq

    table = pq.read_table(data_file)
    rows = table.slice(0, DRY_ROWS).to_pylist()
    for row in rows:
        row.pop("images", None)
        row["ground_truth"] = str((row.get("reward_model") or {}).get("ground_truth"))
    batch = batch_of(rows, [row["ground_truth"] for row in rows])
    for part in parts.parts:
        function = getattr(part.score, "function", None)
        style = getattr(part.score, "style", "server")
        if function is not None and style == "trl":
            missing = [c for c in asked_columns(function) if c not in batch.columns and c not in (*TRL_PARAMETERS, *TRL_SUPPLIED)]
            if missing:
                raise RewardError(f"reward {part.name} asks for column(s) {', '.join(missing)}, which {data_file} does not "
                                  f"have (its columns: {', '.join(sorted(batch.columns))})")
        scored = part.score(batch)
        shown = ", ".join("None" if v is None else f"{v:g}" for v in scored.values)
        extras = f"; extras {', '.join(sorted(k for k in scored.extras if not k.startswith('__')))}" if any(
            not k.startswith("__") for k in scored.extras) else ""
        lines.append(f"reward {part.name} ({style} style, weight {part.weight:g}): {shown} on {len(batch)} rows{extras}")
    return lines


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        answer = {"lines": _check_here(request["plan"], request["data_file"])}
    except UserError as exc:
        answer = {"error": str(exc)}
    except Exception as exc:  # the server down, a bug in the check: said in one line
        answer = {"error": f"the reward check failed: {type(exc).__name__}: {str(exc)[:300]}"}
    child.answer(answer)


if __name__ == "__main__":
    main()
