"""What the verl job's e2e tests share: a real Ray cluster of NPU nodes, the stand-in entrypoint, and
the flow's command line run against the cluster as a user runs it (a subprocess that can be killed).

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_verl_job.py tests/e2e/test_verl_crashes.py

The cluster is `ray.cluster_utils.Cluster` with its dashboard (the job server) on and one custom `NPU`
on each node; verl itself needs GPUs/NPUs and vLLM, so the job runs `tests/verl_stand_in.py`.
Waits are on events (a status, a step in a file) with bounds generous enough for a loaded 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ray._private.utils import write_ray_address
from ray.cluster_utils import Cluster

from grpo_pipeline.backends.metrics import read_metrics
from grpo_pipeline.cluster.ray_cluster import FREE_PORTS
from node_images import node_image

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = ROOT / "tests" / "verl_stand_in.py"
ENTRYPOINT = f"trainer.entrypoint={sys.executable} {STAND_IN}"
# 2 nodes x 1 NPU; 6 steps, a checkpoint every 2. The nodes' NPUs are a Ray resource only: the
# preflight's check of the devices a node has (/dev/davinci*) is dropped.
CLUSTER = ["backend=verl", "cluster.nnodes=2", "cluster.devices_per_node=1", "trainer.total_training_steps=6",
           "trainer.save_freq=2", ENTRYPOINT, "requires.devices=null"]
# How long a test waits for an event (a flow's first step, a job's end, a node joining) before it takes
# it for a hang: on a loaded 2-core machine a flow's start alone (its Prefect API, imports, the dataset
# and model stages) takes minutes. A bound on a hang, never a timing.
EVENT_WAIT_S = 300


def npu_cluster(nodes: int = 2, images: list[dict[str, str]] | None = None) -> Cluster:
    """`nodes` nodes of 2 CPUs and 1 NPU each; the head runs the dashboard (Ray's job API). Each node
    runs with its image (tests/node_images.py: the raylet's environment); by default a healthy one,
    which the preflight passes. `ordered_nodes`: the nodes in the order of `images`."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    images = images or [node_image(Path(tempfile.mkdtemp(prefix="node-image-")))] * nodes
    # Ray's job supervisor starts a job's entrypoint against the cluster that `ray_current_cluster` in the node's
    # temp dir names: in the shared /tmp/ray, the Ray started last on this host, by any test or run (a job then
    # ran on another cluster and failed there). A temp dir of the cluster's own names this cluster only.
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    made = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 2, "resources": {"NPU": 1}, "env_vars": images[0],
                                                         "include_dashboard": True, "temp_dir": temp_dir})
    write_ray_address(made.gcs_address, temp_dir)
    made.ordered_nodes = [made.head_node]
    for image in images[1:]:
        made.ordered_nodes.append(made.add_node(num_cpus=2, resources={"NPU": 1}, env_vars=image, temp_dir=temp_dir))
    made.wait_for_nodes()
    shutdown = made.shutdown

    def shutdown_and_clean() -> None:  # its session logs (10-16 MB a cluster) go with it, as its processes do
        shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    made.shutdown = shutdown_and_clean
    return made


class FlowProcess(subprocess.Popen):
    """The flow's process with its output in a file. A pipe that nobody reads while the flow runs fills
    (64 KiB: verl prints its whole config at the start) and then blocks the flow in its next print."""

    def __init__(self, args: list[str], log: Path, **kwargs):
        self.log = log
        with open(log, "w") as out:
            super().__init__(args, stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def communicate(self, input=None, timeout=None):
        self.wait(timeout=timeout)
        return self.output(), None


def flow_process(address: str, tmp_path: Path, name: str, *overrides: str,
                 stages: str = "fetch_dataset,prepare_checkpoint,train,report", stores: list[str] | None = None,
                 api_url: str | None = None) -> FlowProcess:
    """`python -m grpo_pipeline` for the tiny model on the cluster: its stores under tmp_path unless `stores`
    (the session's prepared ones), its own Prefect API under tmp_path unless `api_url` (the session's)."""
    stores = stores or [f"data.root={tmp_path / 'data'}", f"model.root={tmp_path / 'models'}"]
    settings = [*CLUSTER[1:], *stores, *overrides]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    log = Path(tempfile.mkstemp(dir=tmp_path, prefix=f"flow-{name}-", suffix=".log")[1])
    return FlowProcess(
        [sys.executable, "-m", "grpo_pipeline", "--model", "tiny", "--device", "npu", "--backend", "verl",
         "--ray-address", address, "--run-dir", str(tmp_path), "--run-name", name, "--stages", stages,
         *(arg for item in settings for arg in ("--set", item))],
        log, cwd=ROOT, env=env)


def wait_for(condition: Callable[[], object], what: str, within_s: float = EVENT_WAIT_S,
             process: FlowProcess | None = None):
    """Poll `condition` until it is true (returned); fail naming `what`, with the process's output if it ended."""
    deadline = time.monotonic() + within_s
    while not (found := condition()):
        if process is not None and process.poll() is not None:
            output = process.output()[-3000:]
            raise AssertionError(f"{what}: the flow ended first (exit {process.returncode}):\n{output}")
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s"
        time.sleep(0.2)
    return found


def steps_in(path: Path) -> list[int]:
    return [record.step for record in read_metrics(path)]


def submissions(jobs, run_name: str) -> list:
    return [job for job in jobs.list_jobs() if (job.metadata or {}).get("run_name") == run_name]
