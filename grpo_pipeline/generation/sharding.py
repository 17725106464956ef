"""Where an engine runs: `choose_engine` (the plan's engine on this host, spread over its accelerators
by `sharded`), or a cluster's nodes for a model too big for the flow's host (`on_cluster`, each node
running `generate_on_node`).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --stages evaluate --ray-address head:6379

The prompts are split into contiguous ranges, one Ray task each, and the results are put back in
prompt order. The project's code travels with the job (`connect_ray`), so a node needs only its engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_pipeline.generation.engines import ENGINES, transformers_generate, vllm_generate
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import Generate, GenerationSettings, Response

if TYPE_CHECKING:
    from grpo_pipeline.profiles.platform import Platform


def choose_engine(platform: Platform, devices: int, plan: GenerationPlan) -> Generate:
    """The plan's engine on this host, sharded over its accelerators when it has several."""
    generate = ENGINES[plan.engine]
    return sharded(generate, devices, platform) if platform.accelerated and devices > 1 else generate


def sharded(generate: Generate, shards: int, platform: Platform) -> Generate:
    """`generate` over `shards` Ray tasks (one device each), contiguous prompt ranges, merged in order."""

    def generate_sharded(model_dir: Path, prompts: list[list[dict]], settings: GenerationSettings) -> list[list[Response]]:
        import ray

        from grpo_pipeline.cluster.ray_cluster import connect_ray

        connect_ray(None, None)
        run = ray.remote(**platform.ray_task_options())(generate)
        size = math.ceil(len(prompts) / shards)
        pieces = [prompts[start : start + size] for start in range(0, len(prompts), size)]
        results = ray.get([run.remote(model_dir, piece, settings) for piece in pieces])
        return [group for piece in results for group in piece]

    generate_sharded.where = f"{shards} Ray workers, one device each"
    return generate_sharded


def generate_on_node(model_dir: Path, prompts: list[list[dict]], settings: GenerationSettings) -> tuple[str, list[list[Response]]]:
    """On a cluster node, inside a Ray task that holds its devices: the plan's engine (`settings.plan.engine`,
    decided once at planning, whatever else the node's image has), and what ran, in words. vLLM the node
    lacks is an error naming the node; transformers runs on the device the node's torch sees."""
    import importlib.util
    import socket

    node = socket.gethostname()
    if settings.plan.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(f"{node}: the run's plan generates with vLLM, which this node's image lacks; install "
                               "vllm (vllm-ascend on NPUs) there")
        return f"vllm on {node}", vllm_generate(model_dir, prompts, settings)
    device = _node_torch_device(settings.torch_device)
    if device != settings.torch_device:
        print(f"{node}: Ray offers this task an accelerator, but torch here sees no "
              f"{settings.torch_device} device: generating on the CPU", flush=True)
        settings = settings.on_device("cpu", "float32")
    return f"transformers ({device}) on {node}", transformers_generate(model_dir, prompts, settings)


def _node_torch_device(wanted: str) -> str:
    import torch

    if wanted == "npu":
        try:
            import torch_npu  # noqa: F401

            return "npu" if torch.npu.is_available() else "cpu"
        except Exception:  # not installed, or the Ascend toolkit not loaded
            return "cpu"
    return wanted if wanted == "cpu" or torch.cuda.is_available() else "cpu"


def on_cluster(platform: Platform, replicas: int, devices_each: int, ray_address: str | None,
               runtime_env: dict, check_nodes: Callable[[], None] | None = None) -> Generate:
    """Generation for a model too big for the flow's host: `replicas` Ray tasks on the cluster's
    accelerator nodes, each holding `devices_each` devices (the engine's tensor parallel size) and
    a contiguous range of the prompts; results merged in prompt order. `check_nodes` runs once,
    connected, before the first task is sent (the backend's preflight). Which engine each node had is
    known once they answered (`engine`)."""
    unchecked = [check_nodes] if check_nodes else []

    def generate_on_cluster(model_dir: Path, prompts: list[list[dict]], settings: GenerationSettings) -> list[list[Response]]:
        import ray

        from grpo_pipeline.cluster.ray_cluster import connect_ray

        connect_ray(ray_address, runtime_env)
        while unchecked:
            unchecked.pop()()
        run = ray.remote(**platform.ray_task_options(devices=devices_each))(generate_on_node)
        size = math.ceil(len(prompts) / replicas)
        results = ray.get([run.remote(model_dir, prompts[start : start + size], settings)
                           for start in range(0, len(prompts), size)])
        generate_on_cluster.engine = ", ".join(sorted({engine for engine, _ in results}))
        generate_on_cluster.where = f"{len(results)} Ray tasks on the cluster"
        return [group for _, piece in results for group in piece]

    generate_on_cluster.engine = "the cluster's engine"
    generate_on_cluster.where = f"{replicas} Ray tasks on the cluster"
    return generate_on_cluster
