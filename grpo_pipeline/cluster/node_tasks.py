"""Small tasks run once on every alive node of the run's Ray cluster: whether the run's paths are
there (here), and what each node's image has (cluster/preflight.py).

    python -m grpo_pipeline --model tiny --device cpu --ray-address head-node:6379

Datasets and models must sit on storage every node mounts (`data.root`, `model.root`): a path that
exists only on the head node fails half an hour into a cluster run, on one worker; a small task on
each alive node checks it before training and names the nodes that cannot see the files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from grpo_pipeline.cluster.ray_cluster import connect_ray, node_label
from grpo_pipeline.cluster.ray_address import cluster_address
from grpo_pipeline.errors import UserError

NODE_CHECK_TIMEOUT_S = 120


class NotSharedError(UserError):
    """A path some Ray nodes cannot see."""


def _problems_on_this_node(entries: list[str], readable: list[str], writable: list[str]) -> dict[str, list[str]]:
    """What this node cannot do with each path: see an intact store entry (sizes only: hashing a
    244 GB checkpoint on every node would take minutes; its builder hashed it), read a file or
    folder, write into a folder."""
    from grpo_pipeline.store.content import verify_entry

    problems = {path: verify_entry(Path(path), deep=False) for path in entries}
    for path in readable:
        if not os.access(path, os.R_OK):
            problems[path] = ["it is not there or not readable"]
    for path in writable:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path, prefix=".node-write-check-"):
                pass
        except OSError as exc:
            problems[path] = [f"cannot write there ({exc.strerror or exc})"]
    return {path: found for path, found in problems.items() if found}


def check_shared(path: str, setting: str, ray_address: str | None, runtime_env: dict | None) -> int | None:
    """On a cluster (--ray-address or RAY_ADDRESS), a stage's output must be visible from every node
    before training starts; returns how many nodes see it (None: no cluster, nothing to check)."""
    if cluster_address(ray_address)[0] is None:
        return None
    connect_ray(ray_address, runtime_env)
    return check_visible_on_nodes([Path(path)], setting)


def check_visible_on_nodes(paths: list[Path], setting: str) -> int:
    """Raise NotSharedError naming each node that cannot see an intact `paths` entry; return how many
    nodes were checked. Ray must already be initialised (the caller owns the connection)."""
    return check_paths_on_nodes({setting: [str(p) for p in paths]}, {}, {})


def check_paths_on_nodes(
    entries: dict[str, list[str]], readable: dict[str, list[str]], writable: dict[str, list[str]]
) -> int:
    """One small task pinned to each alive node checks the paths, each under the setting that names
    it: store entries it must see intact, paths it must read, folders it must write into. Raise
    NotSharedError naming each node and what it lacks; return how many nodes were checked."""
    setting_of = {path: setting for group in (entries, readable, writable) for setting, paths in group.items() for path in paths}
    flat = [[path for paths in group.values() for path in paths] for group in (entries, readable, writable)]
    answers = on_every_node(_problems_on_this_node, *flat, timeout_s=NODE_CHECK_TIMEOUT_S)
    failures: dict[str, list[str]] = {}
    for node, problems, exc in answers:
        if exc is not None:  # a node that cannot run the task cannot run training either
            failures.setdefault("", []).append(f"node {node_label(node)}: the check did not run "
                                               f"({type(exc).__name__}: {exc})")
            continue
        for path, found in problems.items():
            verb = "write to" if path in flat[2] else "see"
            failures.setdefault(setting_of[path], []).append(f"node {node_label(node)} cannot {verb} {path}: {found[0]}")
    if failures:
        named = [setting for setting in failures if setting]
        settings = " and ".join(named) or "a path"
        raise NotSharedError(
            f"{settings} {'is' if len(named) < 2 else 'are'} not on storage every Ray node shares: "
            f"{'; '.join(line for lines in failures.values() for line in lines)}; "
            f"set {settings} to a path all nodes mount (e.g. NFS)"
        )
    return len(answers)


def on_every_node(function, *args, timeout_s: float) -> list[tuple[dict, Any, Exception | None]]:
    """`function(*args)` once on each alive node, pinned to it and holding no CPU or device (a job may
    run beside it); per node (Ray's node entry, the answer, the exception instead), within
    `timeout_s` in all: a node that has not answered by then gets a GetTimeoutError and its task is
    cancelled. Ray must already be initialised (the caller owns the connection)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=0)(function)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(*args)
            for node in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answers = []
    for node, ref in zip(nodes, refs):
        if ref not in ready:
            ray.cancel(ref, force=True)
            answers.append((node, None, GetTimeoutError(f"no answer in {timeout_s:.0f} s")))
            continue
        try:
            answers.append((node, ray.get(ref), None))
        except Exception as exc:
            answers.append((node, None, exc))
    return answers
