"""Compose overrides through the pinned verl's own Hydra config, as `verl.trainer.main_ppo` does,
without importing verl (its import pulls torch, ray and vLLM-era pins the orchestrator does not have).

The wheel is installed with `--no-deps` by `make test`; only its YAML files are read here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed; run `make test` (it installs verl==0.9.1 --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def compose_verl(overrides: list[str]) -> dict[str, Any]:
    """The resolved config main_ppo would get for these command-line overrides."""
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def select(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node
