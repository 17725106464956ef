"""Every rule verl 0.9.1 applies to a Ulysses layout of its FSDP engine, checked at planning
(planner/rules.py `fsdp_problems`): one test per rule, each finding the check in verl's own source
(the installed verl==0.9.1, the wheel `pip download verl==0.9.1 --no-deps` gives) and showing that
planning refuses the layout verl would refuse, and passes the one it builds.

    PYTHONPATH=$PWD python -m pytest -q tests/test_verl_fsdp_rules.py

Before these rules were all here, `engine.ulysses_sp=6` on a model of 24 attention and 8 KV heads
passed the dry run, and verl asserted on the KV heads once the job had started building the model.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile

VERL = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
# smollm2-135m's shape made 24 attention heads over 8 KV heads (the probe), on verl's FSDP engine.
HEADS_24_KV_8 = ["model.architecture.num_attention_heads=24", "model.architecture.num_kv_heads=8", "rollout.tp=2",
                 "engine.attn_implementation=flash_attention_2", "data.train_batch_size=24"]


def verl_source(path: str) -> str:
    return " ".join((VERL / path).read_text().split())  # one line: a check wrapped over lines reads as one


def plan(*overrides: str) -> str | None:
    """What planning says of the layout: None when it passes."""
    try:
        resolve_profile("smollm2-135m", "gpu", "verl", overrides=list(overrides))
    except ProfileError as refused:
        return str(refused)
    return None


def ulysses(sp: int, *extra: str) -> list[str]:
    return [*HEADS_24_KV_8, f"engine.ulysses_sp={sp}", f"cluster.devices_per_node={sp}", *extra]


def test_verl_is_the_release_the_rules_are_read_from():
    assert (VERL / "version" / "version").read_text().strip() == "0.9.1"


def test_kv_heads_divide_by_the_ulysses_size_or_it_by_them():
    source = verl_source("models/transformers/monkey_patch.py")
    assert ("assert num_key_value_heads % ulysses_sp_size == 0 or ulysses_sp_size % num_key_value_heads == 0"
            in source)
    for sp in (6, 12):  # neither divides the other: verl asserts when it builds the model
        assert f"engine.ulysses_sp={sp}: Ulysses splits the 8 KV heads over its ranks" in plan(*ulysses(sp))
    for sp in (2, 4, 8, 24):  # 8 % sp == 0, or sp % 8 == 0 (verl repeats the KV heads)
        assert plan(*ulysses(sp)) is None, sp


def test_attention_heads_divide_by_the_ulysses_size():
    source = verl_source("models/transformers/monkey_patch.py")
    assert "assert num_attention_heads % ulysses_sp_size == 0" in source
    assert "Ulysses splits the 24 attention heads over its ranks" in plan(*ulysses(16))  # 16 % 8 == 0: the KV rule holds
    assert plan(*ulysses(8)) is None


def test_the_ulysses_size_divides_the_world_into_its_device_mesh():
    source = verl_source("workers/engine/fsdp/transformer_impl.py")
    assert ('init_device_mesh( device_name, mesh_shape=(dp_size, self.ulysses_sequence_parallel_size), '
            'mesh_dim_names=["dp", "sp"] )') in source
    assert "return torch.distributed.get_world_size() // self.ulysses_sequence_parallel_size" in source
    assert "engine.ulysses_sp=4: must divide the world size 6" in plan(*ulysses(4), "cluster.devices_per_node=6")


def test_ulysses_needs_packed_sequences():
    source = verl_source("workers/engine/fsdp/transformer_impl.py")
    assert "if self.engine_config.ulysses_sequence_parallel_size > 1 and not self.use_remove_padding: raise ValueError(" \
           in source
    assert "needs packed sequences" in plan(*ulysses(4), "engine.use_remove_padding=false")


def test_the_sequences_of_a_step_divide_over_every_device():
    source = verl_source("utils/config.py")
    assert "minimal_bsz = n_gpus" in source
    assert "assert real_train_batch_size % minimal_bsz == 0" in source
    refused = plan(*ulysses(4), "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
                   "algorithm.rollout_n=2", "actor.ppo_micro_batch_size_per_gpu=1")
    assert "3 prompts x rollout_n 2 = 6 sequences must divide over the world's 4 devices" in refused


def test_a_mini_batch_divides_over_the_data_parallel_ranks_ulysses_leaves():
    source = verl_source("workers/engine_workers.py")
    assert "assert mini_batch_size % self.engine.get_data_parallel_size() == 0" in source
    # 4 devices, Ulysses 2: 2 data-parallel ranks; a mini batch of 1 prompt x 3 responses does not split.
    refused = plan(*ulysses(2), "cluster.devices_per_node=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=1",
                   "algorithm.rollout_n=3", "actor.ppo_micro_batch_size_per_gpu=1")
    assert refused is not None and "actor.ppo_mini_batch_size=1: 1 prompts x rollout_n 3 = 3 sequences" in refused


def test_the_deprecated_global_micro_batch_rule_does_not_apply_to_the_rendered_command():
    """verl's `ppo_micro_batch_size * ulysses_sequence_parallel_size >= n_gpus` reads the deprecated global
    micro batch, which the rendered command never sets (it sets `..._per_gpu`): nothing to check."""
    source = verl_source("workers/config/actor.py")
    assert re.search(r"if self\.ppo_micro_batch_size is not None: .*? if self\.ppo_micro_batch_size \* sp_size < n_gpus",
                     source)
    from grpo_pipeline.backends.verl.command import verl_command  # noqa: F401  (the renderer the rule is about)

    rendered = (Path(__file__).resolve().parents[1] / "grpo_pipeline" / "backends" / "verl" / "command.py").read_text()
    assert "ppo_micro_batch_size_per_gpu" in rendered and '.ppo_micro_batch_size"' not in rendered
