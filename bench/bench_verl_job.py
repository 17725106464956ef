"""The verl backend's job path on a local 2-node Ray cluster: how long from the train stage's start to
the job RUNNING, and what following the job (log tail, metrics, status polls) costs a training step.

    .venv/bin/python bench/bench_verl_job.py                 # 3 rounds of each
    .venv/bin/python bench/bench_verl_job.py --rounds 5 --steps 30 --work-mb 64

The cluster is `ray.cluster_utils.Cluster` (dashboard on, one custom `NPU` per node); the job runs
`tests/verl_stand_in.py`, which composes the overrides through verl's own Hydra config and joins Ray
as main_ppo does, like verl at the process boundary.

1. Start to RUNNING: `VerlBackend.train` from its call until Ray reports the job RUNNING, split into
   readiness (connect, wait for the nodes, the per-node access checks, the job recorded in the run's
   folder) and submit to RUNNING (the submit call, Ray's runtime env and the entrypoint's process).
2. Follower overhead: the same CPU-bound job (each step hashes `--work-mb` MB) followed by the backend
   vs submitted directly and only waited for, alternating; the step times are the job's own
   (`timing_s/step` from verl's file logger). Printed: median step time of each and their ratio, and
   the CPU time the flow process spent following, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS  # noqa: E402
from ray.job_submission import JobSubmissionClient  # noqa: E402

from grpo_pipeline.backends import backend_for  # noqa: E402
from grpo_pipeline.backends.base import TrainingInputs, TrainingRun  # noqa: E402
from grpo_pipeline.backends.verl.job import job_spec, read_record  # noqa: E402
from grpo_pipeline.stages.plan import resolve_profile  # noqa: E402
from grpo_pipeline.generation.plan import plan_generation  # noqa: E402
from grpo_pipeline.profiles.schema import DataSection  # noqa: E402
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset  # noqa: E402
from grpo_pipeline.stages.environment import resolve_environment  # noqa: E402

STAND_IN = ROOT / "tests" / "verl_stand_in.py"


class Quiet:
    """A `TrainingProgress` that only notes when the first step arrived."""

    def __init__(self):
        self.first_step_at = None

    def started(self, max_steps, resumed_from): ...

    def step(self, metrics):
        self.first_step_at = self.first_step_at or time.monotonic()

    def note(self, message): ...

    def output(self, line): ...

    def nodes(self, title, table): ...


def make_run(cluster, data, work: Path, name: str, steps: int, env: dict[str, str]):
    overrides = ["cluster.nnodes=2", "cluster.devices_per_node=1", f"trainer.total_training_steps={steps}",
                 f"trainer.save_freq={steps}", f"trainer.entrypoint={sys.executable} {STAND_IN}",
                 *(f"env.{k}={v}" for k, v in env.items())]
    profile = resolve_profile("tiny", "npu", "verl", overrides=overrides)
    run_dir = work / name
    inputs = TrainingInputs(model_path=str(work), train_files=data.train_files, val_files=data.val_files,
                            checkpoint_dir=str(run_dir / "checkpoints"))
    runtime_env = resolve_environment(profile, ray_address=cluster.address).ray_runtime_env()
    return profile, TrainingRun(inputs=inputs, run_dir=str(run_dir), run_name=name, devices_here=0,
                                ray_address=cluster.address, runtime_env=runtime_env, generation=plan_generation(profile))


def time_to_running(cluster, jobs, data, work: Path, rounds: int) -> dict:
    phases = {"readiness_s": [], "submit_to_running_s": [], "train_start_to_running_s": []}
    for index in range(rounds):
        profile, run = make_run(cluster, data, work, f"start-{index}", 2, {})
        seen: dict[str, float] = {}

        def watch():
            while "running" not in seen:
                record = read_record(Path(run.run_dir))
                if record is not None:
                    seen.setdefault("recorded", time.monotonic())
                    try:
                        if jobs.get_job_status(record.submission_id) == "RUNNING":
                            seen["running"] = time.monotonic()
                    except RuntimeError:  # recorded, not submitted yet
                        pass
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        started = time.monotonic()
        watcher.start()
        backend_for("verl").train(profile, run, Quiet())
        watcher.join(timeout=10)
        phases["readiness_s"].append(seen["recorded"] - started)
        phases["submit_to_running_s"].append(seen["running"] - seen["recorded"])
        phases["train_start_to_running_s"].append(seen["running"] - started)
    # The first round also connects this process to the cluster (once per flow run in the pipeline).
    return {name: {"first": round(values[0], 2), "median": round(statistics.median(values), 2)}
            for name, values in phases.items()}


def step_times(metrics_file: str) -> list[float]:
    times = []
    for line in Path(metrics_file).read_text().splitlines():
        data = json.loads(line)["data"]
        if "timing_s/step" in data:
            times.append(data["timing_s/step"])
    return times[1:]  # the first step also warms the page cache


def follower_overhead(cluster, jobs, data, work: Path, rounds: int, steps: int, work_mb: int) -> dict:
    followed, unfollowed, cpu_per_step = [], [], []
    env = {"STAND_IN_STEP_WORK_MB": str(work_mb)}
    for index in range(rounds):
        profile, run = make_run(cluster, data, work, f"followed-{index}", steps, env)
        cpu = time.process_time()
        backend_for("verl").train(profile, run, Quiet())
        cpu_per_step.append((time.process_time() - cpu) / steps)
        followed += step_times(read_record(Path(run.run_dir)).metrics_file)

        profile, run = make_run(cluster, data, work, f"bare-{index}", steps, env)
        spec = job_spec(profile, run.inputs, Path(run.run_dir), run.run_name, run.runtime_env, "bare00", 1)
        Path(spec.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        jobs.submit_job(entrypoint=spec.entrypoint, submission_id=spec.submission_id, runtime_env=spec.runtime_env)
        while jobs.get_job_status(spec.submission_id) not in ("SUCCEEDED", "FAILED", "STOPPED"):
            time.sleep(5)
        unfollowed += step_times(spec.metrics_file)
    followed_s, bare_s = statistics.median(followed), statistics.median(unfollowed)
    return {"step_s_followed": round(followed_s, 4), "step_s_unfollowed": round(bare_s, 4),
            "ratio": round(followed_s / bare_s, 3), "follower_cpu_ms_per_step": round(1000 * statistics.median(cpu_per_step), 1),
            "steps_timed_each": len(followed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps of each followed / unfollowed job")
    parser.add_argument("--work-mb", type=int, default=400, help="MB hashed per step (a CPU-bound step)")
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 2, "resources": {"NPU": 1},
                                                            "include_dashboard": True})
    cluster.add_node(num_cpus=2, resources={"NPU": 1})
    cluster.wait_for_nodes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            data = fetch_dataset(DataSpec.from_profile(DataSection(root=str(work / "data"))))
            jobs = JobSubmissionClient(cluster.address)
            results = {"command": "python bench/bench_verl_job.py " + " ".join(sys.argv[1:]),
                       "start_to_running": time_to_running(cluster, jobs, data, work, args.rounds),
                       "follower": follower_overhead(cluster, jobs, data, work, args.rounds, args.steps, args.work_mb)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
