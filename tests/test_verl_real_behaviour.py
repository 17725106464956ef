"""What verl 0.9.1 does at its process boundary, read from its source (docs/verl-stand-in.md has the
file:line of each), and the pipeline's parsers reading it: Hydra's real exit paths, Ray's coloured
worker prefix, the lines a fresh start prints, orjson's records, the v1 trainer's step count and the
checkpoint layouts of the FSDP and Megatron engines as the stand-in (tests/verl_stand_in.py) writes them.

    PYTHONPATH=$PWD python -m pytest -q tests/test_verl_real_behaviour.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_pipeline.backends.verl.steps import planned_steps, step_count_problem
from grpo_pipeline.backends.verl.checkpoint import verl_hf_dir
from grpo_pipeline.backends.verl.failures import diagnose
from grpo_pipeline.backends.verl.follow import JobLog, VerlMetrics, steps_missing_from
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.loader import resolve_profile
from verl_config import compose_verl

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = ROOT / "tests" / "verl_stand_in.py"
CYAN, RESET = "\x1b[36m", "\x1b[0m"  # Ray's colour around a worker's "(TaskRunnerV1 pid=N)" prefix


def _stand_in(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STAND_IN), *overrides], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


@pytest.mark.e2e  # runs the stand-in as a subprocess
def test_hydras_exit_paths_are_read_as_config_errors():
    """A bad key fails in Hydra's composition (no "Error executing job" line); a failed check of
    validate_config is an exception in main, which Hydra prints after "Error executing job with
    overrides". Both exit 1, and both are config errors to the flow."""
    bad_key = _stand_in("trainer.no_such_key=1")
    assert bad_key.returncode == 1 and "Error executing job" not in bad_key.stderr
    assert diagnose(bad_key.stderr).line == "Could not override 'trainer.no_such_key'. Key 'no_such_key' is not in struct"
    bad_batch = _stand_in("data.train_batch_size=3", "trainer.n_gpus_per_node=2")
    assert bad_batch.returncode == 1 and bad_batch.stderr.startswith("Error executing job with overrides: [")
    cause = diagnose(bad_batch.stderr)
    assert cause == ("config", "AssertionError: real_train_batch_size (3) must be divisible by minimal possible batch "
                               "size (2)")


def test_hydras_header_and_a_fresh_starts_tracker_line_are_no_config_errors():
    """verl prints "Checkpoint tracker file does not exist" at every fresh start with resume_mode=auto,
    and Hydra prints its header before ANY exception: a CUDA OOM after both is no config error."""
    log = "\n".join([
        f"{CYAN}(TaskRunnerV1 pid=812){RESET} Checkpoint tracker file does not exist: /shared/run/checkpoints/"
        "latest_checkpointed_iteration.txt",
        f"{CYAN}(TaskRunnerV1 pid=812){RESET} INFO:2026-12-04 10:00:00,000:Training from scratch",
        "Error executing job with overrides: ['trainer.total_training_steps=40']",
        "Traceback (most recent call last):",
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::TaskRunnerV1.run() (pid=812, ip=10.0.0.3)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "",
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
    ])
    cause = diagnose(log, "Job entrypoint command failed with exit code 1")
    assert cause.kind == "unknown" and cause.line.startswith("torch.OutOfMemoryError: CUDA out of memory")


def test_rays_coloured_worker_prefix_is_read_and_shown_without_its_codes():
    line = f"{CYAN}(TaskRunnerV1 pid=812, ip=10.0.0.3){RESET} AssertionError: ppo_mini_batch_size must be divisible"
    assert diagnose(line) == ("config", "AssertionError: ppo_mini_batch_size must be divisible")

    class Ended:
        async def tail_job_logs(self, job_id):
            return
            yield

    shown = JobLog(Ended(), "grpo-run-abc-1").finish(f"{line}\n{CYAN}(TaskRunnerV1 pid=812){RESET} step:1 - a:1\n")
    assert shown == [line.replace(CYAN, "").replace(RESET, ""), "(TaskRunnerV1 pid=812) step:1 - a:1"]


def _verl_file(path: Path, *records: tuple[int, dict]) -> Path:
    """verl's FileLogger: orjson with OPT_SERIALIZE_NUMPY (compact; numpy scalars; NaN as null)."""
    with open(path, "ab") as handle:
        for step, data in records:
            handle.write(orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    return path


def _trained(step: int, reward: float) -> dict:
    return {"training/global_step": step, "training/epoch": 0, "critic/score/mean": np.float64(reward),
            "timing_s/step": 2.0, "response_length/mean": np.float64(10.0), "training/num_turns/mean": np.float64(1)}


def test_orjsons_records_are_the_runs_steps_and_a_step_with_a_null_reward_still_marks_a_trained_attempt(tmp_path):
    first = _verl_file(tmp_path / "metrics-grpo-r-c0ffee-1.jsonl", (1, _trained(1, float("nan"))), (2, _trained(2, 0.5)))
    assert first.read_bytes().startswith(b'{"step":1,"data":{"training/global_step":1,"training/epoch":0,'
                                         b'"critic/score/mean":null,')
    # A null reward is a NaN one (every sample aborted): a step, for the non_finite guard to stop.
    assert [(r.step, str(r.reward_mean)) for r in VerlMetrics(first, None, 8, None).new()] == [(1, "nan"), (2, "0.5")]
    # Attempt 2 resumed from step 2 with no validation first (val_before_train=false, the profile's
    # default): its first record is a trained step, whose reward happens to be null.
    second = _verl_file(tmp_path / "metrics-grpo-r-c0ffee-2.jsonl", (3, _trained(3, float("nan"))), (4, _trained(4, 0.7)))
    missing = steps_missing_from([], [first, second], 2, 8)
    assert [(r.step, r.resumed_from) for r in missing] == [(1, None), (2, None), (3, 2), (4, 2)]


def _rows(tmp_path: Path, n: int) -> list[str]:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["p"] * n}), path)
    return [str(path)]


def test_a_step_count_verls_loop_cannot_reach_is_refused_before_anything_is_submitted(tmp_path):
    """v1 trainer_base.fit stops after trainer.total_epochs even when total_training_steps asks for more,
    and without saving its last step; with less than one batch of data it divides by zero."""
    files = _rows(tmp_path, 100)  # 12 whole batches of 8
    profile = resolve_profile("tiny", "npu", "verl", overrides=["trainer.total_training_steps=40"])
    assert step_count_problem(profile, files) == (
        "trainer.total_training_steps=40 is more than trainer.total_epochs=1 of 12 whole batches of 8 give; verl would "
        "stop after its last epoch without saving its last step: set trainer.total_epochs=4")
    four = resolve_profile("tiny", "npu", "verl", overrides=["trainer.total_training_steps=40", "trainer.total_epochs=4"])
    assert step_count_problem(four, files) is None and planned_steps(four, files) == 40
    assert "holds less than one batch" in step_count_problem(profile, _rows(tmp_path, 7))


def _composed(tmp_path: Path, model: Path, *overrides: str) -> dict:
    return compose_verl([f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                         "trainer.n_gpus_per_node=2", *overrides])


@pytest.fixture
def stand_in_module():
    sys.path.insert(0, str(ROOT / "tests"))
    import verl_stand_in

    return verl_stand_in


def test_the_fsdp_engines_step_exports_only_when_it_saved_hf_weights(tmp_path, tiny_model_dir, stand_in_module):
    config = _composed(tmp_path, tiny_model_dir, "model_engine=dp")
    stand_in_module._save(tmp_path / "ckpt", 2, config)
    actor = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert {p.name for p in actor.iterdir()} >= {"model_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt",
                                                "extra_state_world_size_2_rank_1.pt", "fsdp_config.json", "huggingface"}
    assert (actor / "huggingface" / "config.json").is_file() and not list((actor / "huggingface").glob("*.safetensors"))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    with pytest.raises(UserError, match=r"add hf_model to actor.checkpoint_save_contents .* python -m verl.model_merger "
                                        r"merge --backend fsdp"):
        verl_hf_dir(tmp_path / "ckpt" / "global_step_2")
    with_hf = _composed(tmp_path, tiny_model_dir, "model_engine=dp",
                        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    stand_in_module._save(tmp_path / "ckpt", 4, with_hf)
    assert verl_hf_dir(tmp_path / "ckpt" / "global_step_4") == tmp_path / "ckpt" / "global_step_4" / "actor" / "huggingface"


def test_a_megatron_dist_checkpoint_step_has_no_hf_folder_and_is_named_by_the_base_model(tmp_path, tiny_model_dir,
                                                                                          stand_in_module):
    """With use_dist_checkpointing and no 'hf_model', verl 0.9.1's Megatron manager writes no
    model/huggingface (not even the config): the export needs the base model's config."""
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / ".metadata").write_bytes(b"")
    config = _composed(tmp_path, tiny_model_dir, "model_engine=megatron",
                       "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                       f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={dist}")
    stand_in_module._save(tmp_path / "ckpt", 2, config)
    actor = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert (actor / "model" / "dist_ckpt" / ".metadata").is_file() and not (actor / "model" / "huggingface").exists()
    assert (actor / "ckpt_contents.json").is_file() and (actor / "optimizer" / "dist_ckpt").is_dir()
    with pytest.raises(UserError, match=r"no HF config to name the dist checkpoint's tensors: verl writes "
                                        r"actor/model/huggingface only when it saves HF weights"):
        verl_hf_dir(tmp_path / "ckpt" / "global_step_2")
    # Without dist checkpointing the bridge's HF weights, config and tokenizer are in model/huggingface.
    stand_in_module._save(tmp_path / "ckpt", 4, _composed(tmp_path, tiny_model_dir, "model_engine=megatron"))
    assert verl_hf_dir(tmp_path / "ckpt" / "global_step_4") == (
        tmp_path / "ckpt" / "global_step_4" / "actor" / "model" / "huggingface")
