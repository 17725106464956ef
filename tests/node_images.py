"""Node images for a local Ray cluster whose nodes differ, the way a real cluster's images differ.

Each node's raylet starts with its own environment (`Cluster.add_node(env_vars=...)`), and the Ray
workers it spawns inherit it: a folder of installed distributions put first on PYTHONPATH (their
dist-info metadata and, where the preflight imports one, a module), and ASCEND_HOME_PATH naming a
CANN install file. The test environment itself has torch (a CPU build), verl and megatron-core; a
folder here can add what it lacks (torch_npu, vLLM, vllm-ascend, a bridge) or shadow one of them at
another version, which the metadata lookup finds first.
"""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

TORCH_RELEASE = ".".join(metadata.version("torch").split("+")[0].split(".")[:3])
# What the tiny model's NPU run needs that the test environment lacks (megatron-bridge: the profile's
# default bridge, which must know the tiny model's architecture).
# TransferQueue: verl 0.9.1's default trainer imports it (the `verl-core` extra).
HEALTHY = {"torch-npu": TORCH_RELEASE, "vllm": "0.23.0", "vllm-ascend": "0.23.0", "megatron-bridge": "0.6.2",
           "TransferQueue": "0.1.10"}
BRIDGE_KNOWS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


def install(site: Path, name: str, version: str, files: dict[str, str] | None = None) -> None:
    """A distribution as pip leaves it: its dist-info with METADATA and RECORD, and its files."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    for relative, text in (files or {}).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)


def node_image(root: Path, *, without: tuple[str, ...] = (), versions: dict[str, str] | None = None,
               bridge_knows: list[str] | None = None, workers_hang: bool = False) -> dict[str, str]:
    """A node image under `root`: the healthy one, less `without`, with `versions` changed or added;
    `workers_hang`: its Ray workers never start (the node's raylet and agents do). Returns the
    raylet's environment."""
    site = root / "site-packages"
    if workers_hang:
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import sys, time\nif any(arg.endswith('default_worker.py') for arg in sys.orig_argv):\n    time.sleep(3600)\n")
    for name, version in {**HEALTHY, **(versions or {})}.items():
        if name in without:
            continue
        files = {}
        if name == "megatron-bridge":  # `megatron` is a namespace package shared with megatron-core
            files["megatron/bridge/__init__.py"] = (
                "class AutoBridge:\n"
                "    @staticmethod\n"
                f"    def list_supported_models():\n        return {bridge_knows or BRIDGE_KNOWS!r}\n")
        if name == "TransferQueue":
            files["transfer_queue/__init__.py"] = ""
        install(site, name, version, files)
    cann = root / "cann"
    (cann / "x86_64-linux").mkdir(parents=True, exist_ok=True)
    (cann / "x86_64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\n")
    return {"PYTHONPATH": str(site), "ASCEND_HOME_PATH": str(cann)}
