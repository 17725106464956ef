"""The local backend refuses bad input before any worker starts, with the field and the fix."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_pipeline.backends.local.mapping import grpo_fields
from grpo_pipeline.generation.plan import plan_generation
from grpo_pipeline.backends.local.settings import check_prompt_lengths, plan_local_training
from grpo_pipeline.errors import ProfileError, UserError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.data.rl_data import arith_splits


@pytest.fixture(scope="module")
def arith_train(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    pq.write_table(arith_splits(64, 8, seed=0)["train"], path)
    return str(path)


def plan(tmp_path, train_file, model="builtin:tiny", devices_here=2, *overrides):
    profile = resolve_profile("tiny", "cpu", overrides=list(overrides))
    return plan_local_training(profile, [train_file], model, tmp_path / "run", devices_here, plan_generation(profile))


def test_the_profile_maps_to_trl_explicitly(tmp_path, arith_train):
    settings = plan(tmp_path, arith_train, "m", 2, "cluster.devices_per_node=2", "algorithm.use_kl_loss=true",
                    "algorithm.kl_loss_coef=0.01", "algorithm.clip_ratio_high=0.28", "trainer.total_training_steps=6")
    grpo = settings.grpo
    assert grpo.num_generations == 4 and grpo.beta == 0.01 and grpo.epsilon_high == 0.28
    assert grpo.loss_type == "dapo" and grpo.lr_scheduler_type == "constant"
    assert grpo.generation_batch_size == 32 and grpo.per_device_train_batch_size == 8
    assert grpo.gradient_accumulation_steps == 2  # 8 prompts x 4 completions over 2 workers x 8
    assert settings.max_steps == 6 and settings.save_steps == 4 and settings.platform.comm_backend == "gloo"
    # verl updates several times per batch when the mini batch is smaller: so does TRL, in optimizer steps.
    halves = plan(tmp_path, arith_train, "m", 2, "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
                  "trainer.total_training_steps=6")
    assert halves.max_steps == 12 and halves.save_steps == 8
    no_kl = resolve_profile("tiny", "cpu", overrides=["algorithm.use_kl_loss=false"])
    assert grpo_fields(no_kl, 1, plan_generation(no_kl))[0].beta == 0.0


def test_the_generation_settings_reach_trl_and_the_worker(tmp_path, arith_train, monkeypatch):
    cpu = plan(tmp_path, arith_train, "m", 2)
    assert cpu.grpo.cache_implementation is None and cpu.generation.compile is False  # CPU: eager, dynamic
    assert cpu.grpo.use_vllm is False
    fast = plan(tmp_path, arith_train, "m", 2, "generation.cache=static", "generation.compile=true",
                "generation.steps_per_generation=4", "generation.attn_implementation=eager")
    assert fast.grpo.cache_implementation == "static" and fast.grpo.generation_batch_size == 4 * 32
    assert (fast.generation.compile, fast.generation.attn_implementation) == (True, "eager")
    gpu = resolve_profile("tiny", "gpu")  # the device's defaults: the fastest path measured on an H200
    assert (gpu.generation.cache, gpu.generation.compile, gpu.generation.steps_per_generation) == ("static", True, 4)
    generate = plan_generation(resolve_profile("tiny", "gpu", overrides=["generation.decoder=generate"]))
    assert generate.describe() == ("transformers generate (static cache, compiled decoding, "
                                   "sdpa attention), 4 step(s)' prompts per generation")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "vllm" else None)
    gpu = resolve_profile("tiny", "gpu", overrides=["rollout.gpu_memory_utilization=0.4"])
    vllm = plan_generation(gpu)  # decided once: vLLM, and no decoder of transformers' to pick
    assert (vllm.engine, vllm.decoder, vllm.native) == ("vllm", None, False)
    colocated = grpo_fields(gpu, 1, vllm)[0]
    assert (colocated.use_vllm, colocated.vllm_mode, colocated.vllm_gpu_memory_utilization) == (True, "colocate", 0.4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generation.compile=true"], "generation.compile=true needs generation.cache=static"),
        (["generation.engine=vllm"], "generation.engine=vllm on device cpu: vLLM needs a GPU or NPU"),
    ],
)
def test_generation_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ProfileError, match=message):
        resolve_profile("tiny", "cpu", overrides=overrides)


@pytest.mark.parametrize(
    "overrides, devices_here, message",
    [
        (["cluster.devices_per_node=4"], 2, "cluster.devices_per_node=4: 4 training workers but this host has 2 CPU cores"),
        # A group size that does not divide the batch: caught by the profile's own validation already.
        (["algorithm.rollout_n=3", "cluster.devices_per_node=2"], 2,
         "8 prompts x rollout_n 3 = 24 sequences do not split over 2 ranks"),
        (["algorithm.use_kl_in_reward=true"], 2, "no in-reward KL"),
        (["algorithm.loss_agg_mode=token-sum"], 2, "the local backend supports token-mean"),
    ],
)
def test_bad_layouts_are_refused(tmp_path, arith_train, overrides, devices_here, message):
    with pytest.raises(ProfileError, match=message.replace("(", "\\(").replace(")", "\\)")):
        plan(tmp_path, arith_train, "m", devices_here, *overrides)


def test_a_dataset_without_the_reward_columns_is_refused(tmp_path):
    bare = tmp_path / "bare.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), bare)
    with pytest.raises(UserError, match="no prompt, data_source, reward_model column"):
        plan(tmp_path, str(bare))
    other = tmp_path / "math.parquet"
    table = arith_splits(4, 2, seed=0)["train"]
    pq.write_table(table.set_column(0, "data_source", pa.array(["lighteval/MATH"] * 4)), other)
    with pytest.raises(UserError, match="no built-in reward for data_source lighteval/MATH"):
        plan(tmp_path, str(other))


def test_overlong_prompts_are_refused_or_filtered(tmp_path, arith_train, tiny_model_dir):
    short = plan(tmp_path, arith_train, str(tiny_model_dir), 2, "data.max_prompt_length=8")
    with pytest.raises(ProfileError, match="data.max_prompt_length=8: 64 of 64 training prompts are longer"):
        check_prompt_lengths(short)
    filtered = plan(tmp_path, arith_train, str(tiny_model_dir), 2, "data.max_prompt_length=8", "data.filter_overlong_prompts=true")
    assert check_prompt_lengths(filtered) == 64
    assert check_prompt_lengths(plan(tmp_path, arith_train, str(tiny_model_dir))) == 0


def one_host_with(gpus: int) -> dict:
    """The device probe's answer on a host with `gpus` H200s."""
    return {"npu": {"status": "absent", "detail": "torch_npu is not installed"},
            "gpu": {"status": "available", "count": gpus, "names": ["NVIDIA H200"] * gpus,
                    "memory_gib": [139.8] * gpus, "cuda_version": "13.0", "detail": f"CUDA sees {gpus} GPU(s)"}}


def test_a_model_directory_on_gpu_plans_for_the_gpus_found(tiny_model_dir):
    from grpo_pipeline.stages.plan import check_plan, profile_for
    from grpo_pipeline.run.request import RunRequest
    from grpo_pipeline.stages.device import detect_device

    request = RunRequest(model=str(tiny_model_dir), device="gpu")
    for gpus in (1, 2):
        device = detect_device("gpu", probe=one_host_with(gpus))
        profile, _, _ = profile_for(request, device)
        assert (profile.backend, profile.cluster.devices_per_node) == ("local", gpus)
        check_plan(request, profile, device, dry_run=True)  # the one-GPU host is not refused
    # What the user names wins over the count, and is checked against it.
    named = RunRequest(model=str(tiny_model_dir), device="gpu", overrides=["cluster.devices_per_node=2"])
    profile, _, _ = profile_for(named, detect_device("gpu", probe=one_host_with(1)))
    assert profile.cluster.devices_per_node == 2
    with pytest.raises(ProfileError, match="2 training workers but this host has 1"):
        check_plan(named, profile, detect_device("gpu", probe=one_host_with(1)), dry_run=True)
    # A recipe's own layout stands (smollm2-135m trains on one GPU whatever the host has).
    recipe, _, _ = profile_for(RunRequest(model="smollm2-135m", device="gpu"), detect_device("gpu", probe=one_host_with(4)))
    assert recipe.cluster.devices_per_node == 1
    # Nothing counted (a dry run that did not probe): the device profile's default.
    unprobed, _, _ = profile_for(request, detect_device("gpu", dry_run=True))
    assert unprobed.cluster.devices_per_node == 8


def test_the_training_batch_is_packed_only_with_kernels_that_take_packed_rows(tmp_path, arith_train):
    assert not plan(tmp_path, arith_train).padding_free  # sdpa on the CPU: a dense mask would cost more
    packed = plan(tmp_path, arith_train, "m", 2, "generation.attn_implementation=flash_attention_2")
    assert packed.padding_free
    assert not plan(tmp_path, arith_train, "m", 2, "generation.attn_implementation=flash_attention_2",
                    "engine.use_remove_padding=false").padding_free


def test_several_updates_a_generation_round_say_what_they_change():
    """generation.steps_per_generation > 1 is a lever verl lacks: the dry run's `# algorithm:` line says how stale
    the rollouts get and what corrects for it."""
    from grpo_pipeline.backends import backend_for
    from grpo_pipeline.backends.local.mapping import staleness_note

    one = resolve_profile("tiny", "cpu")
    assert staleness_note(one, plan_generation(one)) is None
    four = resolve_profile("tiny", "cpu", overrides=["generation.steps_per_generation=4", "actor.ppo_mini_batch_size=4",
                                                     "actor.ppo_micro_batch_size_per_gpu=4"])
    (note,) = backend_for("local").algorithm_notes(four, plan_generation(four))
    assert note.startswith("generation.steps_per_generation=4: one rollout round feeds 8 updates (verl: 2), so an update "
                           "trains on rollouts up to 7 updates old (verl: 1); TRL scores the round once with the policy "
                           "that generated it")
    assert backend_for("verl").algorithm_notes(four, plan_generation(four)) == []
