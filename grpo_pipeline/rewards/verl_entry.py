"""The run's reward inside a verl job: the function verl 0.9.1's `reward.custom_reward_function` names.

    python -m grpo_pipeline --model tiny --device gpu --backend verl --set 'reward.functions=[/r.py:compute_score]' --dry-run
    # reward.custom_reward_function.path=pkg://grpo_pipeline.rewards.verl_entry  ...name=compute_score

verl's reward loop calls it once per sample, all of a worker's samples at once on one event loop
(`RewardLoopWorker.compute_score_batch` gathers `NaiveRewardManager.run_single`, which awaits an async
`compute_score`): the calls that arrive together are scored as one batch (a TRL reward gets its list, the
reward server one request), then each gets its sample's result: `{"score": weighted sum, <part>: value,
<extra>: value}`, which verl keeps as the sample's reward and its extras.

The plan and the user's files travel with the job (Ray's `py_modules`: backends/verl/rewards.py writes the
package `grpo_job_rewards`), so no node needs them on its disk.
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from importlib import resources

from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, batch_of

JOB_PACKAGE = "grpo_job_rewards"
PLAN_FILE = "plan.json"
# How long the first call of a batch waits for the others verl sends with it.
GATHER_S = 0.02


@cache
def parts() -> RewardParts:
    """The carried plan, its specs relative to the carried package (its folder differs on every node)."""
    folder = resources.files(JOB_PACKAGE)
    plan = RewardPlan.model_validate(json.loads(folder.joinpath(PLAN_FILE).read_text()))
    for entry in plan.functions:
        entry.spec = str(folder.joinpath(entry.spec))
    return RewardParts(plan)


class _Gathered:
    """The samples of one event loop's current batch, scored once all of them arrived."""

    def __init__(self):
        self.samples: list[tuple[dict, str, asyncio.Future]] = []
        self.flush: asyncio.Task | None = None


_BATCHES: dict[int, _Gathered] = {}


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> dict:
    loop = asyncio.get_running_loop()
    gathered = _BATCHES.setdefault(id(loop), _Gathered())
    row = {"prompt": (extra_info or {}).get("prompt") or [], "data_source": data_source,
           "ground_truth": str(ground_truth), "extra_info": dict(extra_info or {})}
    future = loop.create_future()
    gathered.samples.append((row, solution_str, future))
    if gathered.flush is None:
        gathered.flush = loop.create_task(_score_when_gathered(loop))
    return await future


async def _score_when_gathered(loop) -> None:
    await asyncio.sleep(GATHER_S)
    gathered = _BATCHES.pop(id(loop))
    samples = gathered.samples
    batch = batch_of([row for row, _, _ in samples], [text for _, text, _ in samples])
    try:
        scores = await loop.run_in_executor(None, parts().score, batch)
    except Exception as exc:  # every sample of the batch fails with the one line that names the row
        for *_, future in samples:
            future.set_exception(exc)
        return
    for i, (*_, future) in enumerate(samples):
        result = {"score": scores.rewards[i]}
        result |= {name: values[i] for name, values in {**scores.parts, **scores.extras}.items() if values[i] is not None}
        future.set_result(result)

