"""The cluster preflight's cost (cluster/preflight.py) on simulated clusters of 2 and 16 nodes, beside
what submitting the job itself takes (submit to RUNNING), measured in one run.

    .venv/bin/python bench/bench_preflight.py                    # 2 and 16 nodes, 3 rounds each
    .venv/bin/python bench/bench_preflight.py --nodes 2 4 --rounds 5 --json bench/results-cpu-preflight.json

Each node is a raylet of `ray.cluster_utils.Cluster` (1 CPU, 1 `NPU`) started with the healthy node
image of tests/node_images.py (the verl stack's metadata, a Megatron-Bridge whose registry the
preflight imports and reads in a child process), so the preflight does on each node what it does on
a real one: a Ray task pinned to the node, the package metadata, the child import. Per round:
- cold: a fresh driver (a new Ray job: every node starts a worker for it and unpacks the project's
  code), then the preflight; this is what a run's first preflight pays when nothing ran before it;
- warm: the preflight again on the same driver (the train stage's case: the node-path checks have
  started the workers);
- submit to RUNNING (2-node cluster only): the stand-in entrypoint submitted through Ray's job API
  with the run's runtime env, until Ray reports RUNNING: the floor of a job's own start (verl's own
  start, its workers and vLLM, comes after and takes minutes on a real cluster).
Medians of the rounds are printed; on a 2-core machine 16 raylets share two cores, so the 16-node
figure is an upper bound of what the preflight costs there, where each node has its own CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS  # noqa: E402
from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402

from grpo_pipeline.backends import backend_for  # noqa: E402
from grpo_pipeline.cluster.preflight import run_preflight  # noqa: E402
from grpo_pipeline.cluster.ray_cluster import connect_ray  # noqa: E402
from node_images import node_image  # noqa: E402
from grpo_pipeline.stages.plan import resolve_profile  # noqa: E402
from grpo_pipeline.stages.environment import resolve_environment  # noqa: E402

STAND_IN_SLEEP = "import time; time.sleep(5)"


def cluster_of(nodes: int, image: dict[str, str]) -> Cluster:
    made = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1, "resources": {"NPU": 1},
                                                         "env_vars": image, "include_dashboard": True})
    for _ in range(nodes - 1):
        made.add_node(num_cpus=1, resources={"NPU": 1}, env_vars=image)
    made.wait_for_nodes()
    return made


def submit_to_running(address: str, runtime_env: dict) -> float:
    jobs = JobSubmissionClient(address)
    started = time.monotonic()
    job = jobs.submit_job(entrypoint=f"{sys.executable} -c '{STAND_IN_SLEEP}'", runtime_env=runtime_env)
    while (status := jobs.get_job_status(job)) == JobStatus.PENDING:
        time.sleep(0.02)
    seconds = time.monotonic() - started
    assert status == JobStatus.RUNNING, status
    jobs.stop_job(job)
    return seconds


def measure(nodes: int, rounds: int, image: dict[str, str]) -> dict:
    # What is required does not depend on the layout; the preflight asks every alive node.
    profile = resolve_profile("tiny", "npu", "verl", overrides=["cluster.nnodes=2", "cluster.devices_per_node=1",
                                                                 "requires.devices=null"])
    needs = backend_for("verl").node_requirements(profile, "train")
    runtime_env = resolve_environment(profile, ray_address=None).ray_runtime_env()
    started = time.monotonic()
    cluster = cluster_of(nodes, image)
    cluster_start = time.monotonic() - started
    cold, warm, submit = [], [], []
    try:
        for _ in range(rounds):
            ray.shutdown()
            connect_ray(cluster.address, runtime_env)
            first = run_preflight(needs, "NPU", "train", profile.cluster.preflight_timeout_s)
            again = run_preflight(needs, "NPU", "train", profile.cluster.preflight_timeout_s)
            assert first.refusal() is None and len(first.nodes) == nodes, first.refusal()
            cold.append(first.seconds)
            warm.append(again.seconds)
            if nodes == 2:
                submit.append(submit_to_running(cluster.address, runtime_env))
    finally:
        ray.shutdown()
        cluster.shutdown()
    result = {"nodes": nodes, "rounds": rounds, "cluster_start_s": round(cluster_start, 1),
              "preflight_cold_s": cold, "preflight_warm_s": warm,
              "preflight_cold_median_s": round(statistics.median(cold), 3),
              "preflight_warm_median_s": round(statistics.median(warm), 3)}
    if submit:
        result |= {"submit_to_running_s": [round(s, 3) for s in submit],
                   "submit_to_running_median_s": round(statistics.median(submit), 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    image = node_image(Path(tempfile.mkdtemp(prefix="bench-node-image-")))
    results = []
    for nodes in args.nodes:
        result = measure(nodes, args.rounds, image)
        results.append(result)
        line = (f"{nodes:>3} nodes: preflight cold median {result['preflight_cold_median_s']:.2f} s "
                f"(rounds {', '.join(f'{s:.2f}' for s in result['preflight_cold_s'])}), warm median "
                f"{result['preflight_warm_median_s']:.2f} s")
        if "submit_to_running_median_s" in result:
            line += f"; job submit to RUNNING median {result['submit_to_running_median_s']:.2f} s"
        print(line, flush=True)
    record = {"command": " ".join(["bench/bench_preflight.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "results": results}
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
