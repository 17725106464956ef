"""Every layout rule, failing and passing: the error names the field, the value and a fix."""

from __future__ import annotations

import pytest

from grpo_pipeline.errors import HEADLINE_CHARS, ProfileError
from grpo_pipeline.stages.plan import resolve_profile

Q122 = "qwen3.5-122b-a10b"
Q35 = "qwen3.5-35b-a3b"
TINY_VERL = ("tiny", "gpu", "verl")

# (model, device, backend, failing overrides, passing overrides, fragments of the error)
RULES = {
    "world-size": (Q122, "npu", "auto", ["engine.tp=3"], ["engine.tp=2"],
                   ["engine.tp=3", "does not divide the world size 64", "pick values"]),
    "kv-heads-vs-tp": (Q122, "gpu", "auto", ["engine.tp=4"], ["engine.tp=1"],
                       ["engine.tp=4", "heads (kv 2", "use engine.tp in 1, 2"]),
    "layers-vs-pp": (Q122, "gpu", "auto", ["cluster.nnodes=5", "engine.pp=5"], ["cluster.nnodes=6", "engine.pp=6"],
                     ["engine.pp=5", "48 layers", "use a PP in"]),
    "vpp-split": (Q122, "gpu", "auto", ["engine.vpp=5"], ["engine.vpp=2"],
                  ["engine.vpp=5", "PP x VPP = 10", "use PP x VPP in"]),
    "vpp-needs-pp": (Q35, "gpu", "auto", ["engine.vpp=2"], ["engine.vpp=null"],
                     ["engine.vpp=2", "need engine.pp > 1", "set engine.vpp=null"]),
    "experts-vs-ep": (Q122, "gpu", "auto", ["engine.ep=3"], ["engine.ep=4"],
                      ["engine.ep=3", "256 experts", "use an EP in"]),
    "ep-etp-vs-dp": (Q122, "gpu", "auto", ["engine.ep=32"], ["engine.ep=16"],
                     ["engine.ep=32", "EP x ETP = 32", "lower engine.ep"]),
    "ep-on-dense": (*TINY_VERL, ["engine.ep=2"], ["engine.ep=1"],
                    ["engine.ep=2", "dense", "set engine.ep=1"]),
    "rollout-tp-vs-node": (Q122, "gpu", "auto", ["rollout.tp=12"], ["rollout.tp=16"],
                           ["rollout.tp=12", "part of a node (8 devices)", "use a rollout TP in"]),
    "rollout-tp-vs-heads": (*TINY_VERL, ["cluster.devices_per_node=8", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.tp=8"],
                            ["cluster.devices_per_node=8", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.tp=4"],
                            ["rollout.tp=8", "4 attention heads", "use one of 1, 2, 4"]),
    "rollout-tp-vs-kv-heads": (*TINY_VERL,
                               ["cluster.devices_per_node=6", "actor.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=6",
                                "actor.ppo_mini_batch_size=6", "model.architecture.num_attention_heads=12",
                                "model.architecture.num_kv_heads=4", "rollout.tp=6"],
                               ["cluster.devices_per_node=6", "actor.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=6",
                                "actor.ppo_mini_batch_size=6", "model.architecture.num_attention_heads=12",
                                "model.architecture.num_kv_heads=4", "rollout.tp=2"],
                               ["rollout.tp=6", "4 KV heads"]),
    "mini-batch-divides-batch": (Q122, "gpu", "auto", ["actor.ppo_mini_batch_size=48"], ["actor.ppo_mini_batch_size=32"],
                                 ["actor.ppo_mini_batch_size=48", "must divide data.train_batch_size=128", "use one of"]),
    "mini-batch-not-above-batch": (Q122, "gpu", "auto", ["actor.ppo_mini_batch_size=256"], ["actor.ppo_mini_batch_size=128"],
                                   ["actor.ppo_mini_batch_size=256", "must divide data.train_batch_size=128"]),
    "batch-vs-dp-micro": (Q122, "gpu", "auto", ["actor.ppo_micro_batch_size_per_gpu=7"], ["actor.ppo_micro_batch_size_per_gpu=2"],
                          ["data.train_batch_size=128", "8 ranks", "multiple of 56"]),
    "local-batch-vs-workers": ("tiny", "cpu", "auto", ["cluster.devices_per_node=3"], ["cluster.devices_per_node=2"],
                               ["data.train_batch_size=8", "3 ranks"]),
    "dynamic-bsz-needs-packing": (Q122, "gpu", "auto", ["actor.use_dynamic_bsz=true"],
                                  ["actor.use_dynamic_bsz=true", "engine.use_remove_padding=true"],
                                  ["actor.use_dynamic_bsz=true", "engine.use_remove_padding=false", "set actor.use_dynamic_bsz=false"]),
    "max-model-len": (Q122, "gpu", "auto", ["rollout.max_model_len=4096"], ["rollout.max_model_len=7336"],
                      ["rollout.max_model_len=4096", "= 7336", "set rollout.max_model_len >= 7336"]),
    "verl-needs-accelerator": ("tiny", "cpu", "verl", [], [],
                               ["backend=verl on device cpu", "use --backend local"]),
}


@pytest.mark.parametrize("rule", RULES)
def test_rule_rejects_with_field_value_and_fix(rule):
    model, device, backend, failing, _, fragments = RULES[rule]
    with pytest.raises(ProfileError) as caught:
        resolve_profile(model, device, backend, overrides=failing)
    message = str(caught.value)
    # The headline is one problem and its fix, short enough to read at a glance; any others follow it.
    assert len(message.splitlines()[0]) <= HEADLINE_CHARS, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "verl-needs-accelerator"])
def test_rule_accepts_valid_layout(rule):
    model, device, backend, _, passing, _ = RULES[rule]
    resolve_profile(model, device, backend, overrides=passing)


def test_cpu_runs_with_local_backend():
    assert resolve_profile("tiny", "cpu", "local").backend == "local"


def test_all_problems_are_reported_together():
    with pytest.raises(ProfileError) as caught:
        resolve_profile(Q122, "gpu", overrides=["rollout.tp=12", "rollout.max_model_len=10"])
    assert "rollout.tp=12" in str(caught.value) and "rollout.max_model_len=10" in str(caught.value)


@pytest.mark.parametrize("device", ["gpu", "npu"])
@pytest.mark.parametrize("model", [Q122, Q35])
def test_built_in_recipes_are_valid(model, device):
    profile = resolve_profile(model, device)
    assert profile.backend == "verl"
    assert profile.world_size % (profile.engine.tp * profile.engine.pp * profile.engine.cp) == 0
