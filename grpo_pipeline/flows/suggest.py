"""`--suggest-layout`: what fits before anything starts, as the command line prints it.

    python -m grpo_pipeline --model qwen3.5-35b-a3b --device gpu --suggest-layout               # verl's layouts
    python -m grpo_pipeline --model /models/Qwen3-8B --device gpu --backend local --suggest-layout   # one GPU's step

The layout planner's backend (planner/layouts.py) searches parallel layouts, cheapest first; a backend that
sizes one device's step instead (`Backend.size_table`: the local backend's largest micro batch, full training
and LoRA, backends/local/sizing.py) answers when it is named with --backend.
"""

from __future__ import annotations

import json
import sys

from grpo_pipeline.errors import EXIT_USER_ERROR, UserError
from grpo_pipeline.profiles.backend_table import layout_planner
from grpo_pipeline.profiles.model_size import size_problems
from grpo_pipeline.run.request import RunRequest


def print_layouts(request: RunRequest, as_json: bool) -> int:
    """`--suggest-layout`: the layouts that fit, cheapest first; exit 2 when none does."""
    from grpo_pipeline.planner.layouts import suggest_layouts, suggestion_table
    from grpo_pipeline.stages.device import requested_device
    from grpo_pipeline.stages.plan import layered_profile, one_device_sizes

    kind = requested_device(request.device)
    if kind not in ("gpu", "npu"):
        raise UserError(f"--suggest-layout plans the {layout_planner().name} backend's layouts on GPUs or NPUs, not "
                        f"device {kind!r}; pass --device gpu or --device npu")
    # The profile's own layout may not be valid for this cluster size: the search does not start from it.
    backend = {"auto": layout_planner().name}.get(request.backend, request.backend)
    profile, generation = layered_profile(request.model_copy(update={"backend": backend}), kind)
    if problems := size_problems(profile.model.architecture):
        raise UserError(f"--suggest-layout needs the model's size: {'; '.join(problems)}")
    if (sized := one_device_sizes(profile, generation)) is not None:  # a backend that sizes one device's step
        summary, lines = sized
        print(json.dumps(summary, indent=2) if as_json else "\n".join(lines))
        if summary.get("refusal"):
            print(f"error: {summary['refusal']}", file=sys.stderr)
            return EXIT_USER_ERROR
        return 0
    suggestions, facts = suggest_layouts(profile)
    if as_json:
        print(json.dumps({"facts": facts, "layouts": [
            {"settings": s.settings(), "step_seconds": s.cost, "memory": s.plan.summary()} for s in suggestions]},
            indent=2))
    else:
        print("\n".join(suggestion_table(suggestions, facts, profile)))
    if not suggestions:
        print(f"error: no layout of {profile.model.name} fits {profile.cluster.nnodes} x {profile.cluster.devices_per_node} "
              f"{profile.platform.accelerator or kind} devices; {_no_layout_fix(profile, facts)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _no_layout_fix(profile, facts: dict) -> str:
    """Which way the cluster is wrong: layouts that were never estimated were refused for their batch
    split (more data-parallel ranks than the batch's sequences split over: too many devices), those
    estimated did not fit in memory (too few), and none at all means no layout divides this world."""
    if facts.get("layouts") and not facts.get("estimates"):
        d, n = profile.data, profile.algorithm.rollout_n
        return (f"every layout has more data-parallel ranks than data.train_batch_size {d.train_batch_size} x "
                f"algorithm.rollout_n {n} = {profile.sequences_per_step} sequences split over; use fewer nodes "
                "(--set cluster.nnodes=N) or a larger data.train_batch_size")
    if not facts.get("layouts"):
        return ("no parallel layout divides this many devices for this model; change cluster.nnodes or "
                "cluster.devices_per_node")
    return "add nodes (--set cluster.nnodes=N)"
