"""Is a store entry visible from every node of the Ray cluster?

Datasets and models must sit on storage every node mounts (`data.root`, `model.root`). A path that
exists only on the head node fails half an hour into a cluster run, on one worker; this check runs a
small task on each alive node before training and names the nodes that cannot see the files.
"""

from __future__ import annotations

import os
from pathlib import Path

from profiles.errors import UserError

NODE_CHECK_TIMEOUT_S = 120


class NotSharedError(UserError):
    """A path some Ray nodes cannot see."""


def connect_ray(address: str | None, runtime_env: dict | None) -> None:
    """Join the run's Ray cluster (or start a local one) once per process, with the run's env."""
    import ray

    if not ray.is_initialized():
        # No address: a fresh local Ray ("local"), never whatever /tmp/ray/ray_current_cluster names
        # (a cluster that may be long dead: ray.init would wait on it). A Ray started here runs no
        # dashboard: on a small machine it takes a third of the CPU training needs. A cluster keeps its own.
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "local", runtime_env=runtime_env,
                 log_to_driver=False, include_dashboard=False)


def stop_ray_job() -> bool:
    """End this process's Ray job: Ray stops every actor and task it started (training workers,
    evaluation shards) and frees their devices; a local Ray started here stops too. False when
    this process was not connected."""
    import ray

    if not ray.is_initialized():
        return False
    ray.shutdown()
    return True


def _problems_on_this_node(paths: list[str]) -> dict[str, list[str]]:
    from tasks.store import verify_entry

    # Sizes only: hashing a 244 GB checkpoint on every node would take minutes; the builder hashed it.
    return {path: verify_entry(Path(path), deep=False) for path in paths}


def check_visible_on_nodes(paths: list[Path], setting: str) -> int:
    """Raise NotSharedError naming each node that cannot see an intact `paths` entry; return how many
    nodes were checked. Ray must already be initialised (the caller owns the connection)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    look = ray.remote(num_cpus=0, max_retries=0)(_problems_on_this_node)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    pending = {
        node["NodeManagerAddress"] + f" ({node['NodeID'][:8]})": look.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote([str(p) for p in paths])
        for node in nodes
    }
    failures = []
    for node, ref in pending.items():
        try:
            problems = ray.get(ref, timeout=NODE_CHECK_TIMEOUT_S)
        except Exception as exc:  # a node that cannot run the task cannot run training either
            failures.append(f"node {node}: the check did not run ({type(exc).__name__}: {exc})")
            continue
        failures += [f"node {node} cannot see {path}: {found[0]}" for path, found in problems.items() if found]
    if failures:
        raise NotSharedError(
            f"{setting} is not on storage every Ray node shares: {'; '.join(failures)}; "
            f"set {setting} to a path all nodes mount (e.g. NFS)"
        )
    return len(nodes)
