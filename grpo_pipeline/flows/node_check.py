"""`--preflight`: ask every node of a Ray cluster whether its image can run the run's stages, without
submitting or starting anything (the check the train and evaluate stages run first).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379 --preflight

The requirements are the dry run's `node_requirements` (the backend's, the device profile's and the
recipe's); each stage's answer is printed as the report shows it (a column per distinct image), and a
node that cannot run a stage makes the command exit 2 with the preflight's own lines.
"""

from __future__ import annotations

import sys

from grpo_pipeline.cluster.preflight import run_preflight
from grpo_pipeline.cluster.ray_cluster import connect_ray, disconnect_ray
from grpo_pipeline.cluster.ray_address import cluster_address
from grpo_pipeline.stages.plan import RunPlan
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.errors import EXIT_USER_ERROR, UserError


def check_nodes(request: RunRequest, plan: RunPlan) -> int:
    """Run the preflight of every stage with node requirements; 0 when every node can run them all."""
    if not plan.node_requirements:
        print(f"the {plan.profile.backend} backend runs in the flow's own process: no cluster node needs anything")
        return 0
    if cluster_address(request.ray_address)[0] is None:
        raise UserError("--preflight asks the nodes of a running Ray cluster: pass --ray-address <head>:6379 "
                        "(or set RAY_ADDRESS)")
    connect_ray(request.ray_address, plan.env.ray_runtime_env())
    refusals = []
    try:
        for stage, needs in plan.node_requirements.items():
            checked = run_preflight(needs, plan.profile.platform.ray_resource, stage,
                                    plan.profile.cluster.preflight_timeout_s)
            print(f"# {stage}: {checked.summary_line()}")
            print("\n".join(checked.table()))
            if refusal := checked.refusal():
                refusals.append(refusal)
    finally:
        disconnect_ray()
    for refusal in refusals:
        print(f"error: {refusal}", file=sys.stderr)
    return EXIT_USER_ERROR if refusals else 0
