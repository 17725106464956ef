"""Render a `RunProfile` to verl's trainer command (`python3 -m verl.trainer.main_ppo` + Hydra overrides).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run

Pinned to verl 0.9.1: the overrides compose against its `ppo_trainer` config with
`model_engine=megatron`, or `model_engine=dp` for `engine.strategy: fsdp` (FSDP2;
tests/test_verl_compose.py composes every built-in model x device, and both engines, through verl's own
Hydra config). The orchestrator never imports verl; the cluster image runs it.

Rules the rendering keeps:
- engine settings are declared once in the profile and written to every role that runs the model
  (actor and reference), so turning KL on can never build a reference with other settings;
- each key appears once (settings are collected in a dict before they become arguments);
- no dead settings (`actor_rollout_ref.nccl_timeout` is read by no code in verl);
- the run's reward is verl's own keys (`reward.custom_reward_function`: backends/verl/rewards.py);
- verl's `file` logger is always on: the flow follows a run's metrics through it (backends/verl/follow.py);
- no environment variables: the run's environment reaches every Ray worker on every node through the
  Ray job's `runtime_env` (backends/verl/job.py). Rendering them also as
  `ray_kwargs.ray_init.runtime_env.env_vars` would make Ray refuse main_ppo's `ray.init` ("Failed to
  merge the Job's runtime env ... because of a conflict").
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from grpo_pipeline.backends.base import TrainingInputs
from grpo_pipeline.backends.verl.engines import ADD_OR_OVERRIDE, verl_engine
from grpo_pipeline.backends.verl.lora import lora_settings
from grpo_pipeline.backends.verl.rewards import reward_settings
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.profiles.trackers import tracker_class

VERL_VERSION = "0.9.1"
FILE_LOGGER = "file"

# Strings Hydra reads back unchanged without quotes (identifiers and paths, no digits first).
_PLAIN_STRING = re.compile(r"[A-Za-z_/~][A-Za-z0-9_./~-]*")
_HYDRA_KEYWORDS = {"true", "false", "null", "nan", "inf"}


def _files(paths: list[str]) -> str | list[str]:
    """verl takes one path or a list; one file stays a plain path, as in verl's own examples."""
    return paths[0] if len(paths) == 1 else paths


def verl_settings(profile: RunProfile, inputs: TrainingInputs) -> dict[str, Any]:
    """Every verl key this run sets, in a stable order, each once. `trainer.default_local_dir` is
    absolute (a relative one would land in Ray's per-job working directory)."""
    p, a, alg, r, lp, t = profile, profile.actor, profile.algorithm, profile.rollout, profile.log_prob, profile.trainer
    engine = verl_engine(p)  # the engine's own keys (backends/verl/engines.py)
    settings: dict[str, Any] = {
        "model_engine": engine.model_engine,
        "algorithm.adv_estimator": alg.adv_estimator,
        "algorithm.use_kl_in_reward": alg.use_kl_in_reward,
        "data.train_files": _files(inputs.train_files),
        "data.val_files": _files(inputs.val_files),
        "data.train_batch_size": p.data.train_batch_size,
        "data.max_prompt_length": p.data.max_prompt_length,
        "data.max_response_length": p.data.max_response_length,
        "data.truncation": p.data.truncation,
        "data.filter_overlong_prompts": p.data.filter_overlong_prompts,
        "data.filter_overlong_prompts_workers": p.data.filter_overlong_prompts_workers,
        "actor_rollout_ref.model.path": inputs.model_path,
        "actor_rollout_ref.model.trust_remote_code": p.model.trust_remote_code,
        "actor_rollout_ref.model.enable_gradient_checkpointing": p.model.enable_gradient_checkpointing,
        # verl still reads the model-level switch in places; keep it equal to the engine's.
        "actor_rollout_ref.model.use_remove_padding": p.engine.use_remove_padding,
        **engine.model_settings(p),
        "actor_rollout_ref.actor.optim.lr": alg.lr,
        "actor_rollout_ref.actor.ppo_mini_batch_size": a.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": a.ppo_micro_batch_size_per_gpu,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": a.ppo_max_token_len_per_gpu,
        "actor_rollout_ref.actor.use_dynamic_bsz": a.use_dynamic_bsz,
        "actor_rollout_ref.actor.use_kl_loss": alg.use_kl_loss,
        "actor_rollout_ref.actor.kl_loss_coef": alg.kl_loss_coef,
        "actor_rollout_ref.actor.kl_loss_type": alg.kl_loss_type,
        "actor_rollout_ref.actor.entropy_coeff": alg.entropy_coeff,
        "actor_rollout_ref.actor.clip_ratio_low": alg.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": alg.clip_ratio_high,
        "actor_rollout_ref.actor.loss_agg_mode": alg.loss_agg_mode,
        "actor_rollout_ref.actor.use_torch_compile": a.use_torch_compile,
        "actor_rollout_ref.actor.checkpoint.save_contents": a.checkpoint_save_contents,
        "actor_rollout_ref.actor.checkpoint.strict": a.checkpoint_strict,
    }
    settings.update(engine.actor_settings(p))
    settings.update(engine.role_settings(p, "actor"))
    settings.update(engine.optimizer_settings(p))
    settings.update(engine.role_settings(p, "ref"))
    if inputs.dist_checkpoint_path:  # each rank reads its own shard, actor and reference alike
        for role in ("actor", "ref"):
            settings[f"actor_rollout_ref.{role}.megatron.use_dist_checkpointing"] = True
            settings[f"actor_rollout_ref.{role}.megatron.dist_checkpointing_path"] = inputs.dist_checkpoint_path
    for role in ("rollout", "ref"):
        settings[f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu"] = lp.micro_batch_size_per_gpu
        settings[f"actor_rollout_ref.{role}.log_prob_use_dynamic_bsz"] = lp.use_dynamic_bsz
        settings[f"actor_rollout_ref.{role}.log_prob_max_token_len_per_gpu"] = lp.max_token_len_per_gpu
    settings.update(
        {
            "actor_rollout_ref.rollout.name": r.engine,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": r.tp,
            "actor_rollout_ref.rollout.gpu_memory_utilization": r.gpu_memory_utilization,
            "actor_rollout_ref.rollout.max_num_seqs": r.max_num_seqs,
            "actor_rollout_ref.rollout.n": alg.rollout_n,
            "actor_rollout_ref.rollout.temperature": alg.temperature,
            "actor_rollout_ref.rollout.dtype": r.dtype,
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": r.update_weights_bucket_megabytes,
        }
    )
    settings.update(lora_settings(p))  # the adapter and the rollout's load format it needs (backends/verl/lora.py)
    vllm_kwargs = dict(r.vllm_kwargs)
    if r.max_model_len is not None:
        vllm_kwargs = {"max_model_len": r.max_model_len, **vllm_kwargs}
    for name, value in vllm_kwargs.items():
        settings[f"{ADD_OR_OVERRIDE}actor_rollout_ref.rollout.engine_kwargs.vllm.{name}"] = value
    settings.update(reward_settings(p))
    settings.update(
        {
            "trainer.logger": tracked_loggers(t.logger, p.tracking.trackers),
            "trainer.project_name": tracked_project(p),
            "trainer.experiment_name": t.experiment_name,
            "trainer.nnodes": p.cluster.nnodes,
            "trainer.n_gpus_per_node": p.cluster.devices_per_node,
            "trainer.save_freq": t.save_freq,
            "trainer.test_freq": t.test_freq,
            "trainer.val_before_train": t.val_before_train,
            "trainer.total_epochs": t.total_epochs,
            "trainer.total_training_steps": t.total_training_steps,
            "trainer.resume_mode": t.resume_mode,
            "trainer.default_local_dir": inputs.checkpoint_dir,
        }
    )
    return settings


def tracked_loggers(loggers: list[str], trackers: list[str]) -> list[str]:
    """verl's loggers: the profile's, the run's experiment trackers (verl logs each step to them itself,
    continuing the tracker run the flow opened: backends/verl/job.py), and the file logger, each once."""
    return list(dict.fromkeys([*loggers, *(tracker_class(name).verl_logger for name in trackers), FILE_LOGGER]))


def tracked_project(profile: RunProfile) -> str:
    """verl passes `trainer.project_name` to `wandb.init(project=...)` (and names MLflow's experiment by it
    unless MLFLOW_RUN_ID attaches it to a run, as the tracked job does): the project a tracked tracker
    decides (W&B's), else the trainer's."""
    tracking = profile.tracking
    return next((project for name in tracking.trackers
                 if (project := tracker_class(name).verl_project(getattr(tracking, name)))), profile.trainer.project_name)


def format_value(value: Any) -> str:
    """A Python value as a Hydra override value that parses back to the same value and type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN_STRING.fullmatch(text) and text.lower() not in _HYDRA_KEYWORDS:
        return text
    # Anything else is quoted: unquoted, Hydra would read `300` as an int, `true` as a bool and
    # `a:b` as a dict. Hydra takes double or single quotes, with backslash escapes.
    if '"' not in text and "\\" not in text:
        return f'"{text}"'
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_overrides(settings: dict[str, Any]) -> list[str]:
    return [f"{key}={format_value(value)}" for key, value in settings.items()]


def entrypoint(profile: RunProfile) -> list[str]:
    """`trainer.entrypoint` as argv: verl's `main_ppo` unless the profile names another trainer."""
    return shlex.split(profile.trainer.entrypoint)


def entrypoint_problems(entrypoint: str) -> list[str]:
    """trainer.entrypoint must be shell words that name a command (the Ray job runs it with the overrides)."""
    try:
        words = shlex.split(entrypoint)
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        return [f"trainer.entrypoint={entrypoint!r}: {str(exc).lower()}; close the quote (quotes group a word "
                "that holds spaces, e.g. python3 '/opt/my trainer/main.py')"]
    if not words:
        return ["trainer.entrypoint is empty: it is the command the Ray job runs; leave it out for verl's own "
                "(python3 -m verl.trainer.main_ppo) or name the trainer to run"]
    return []


def verl_command(profile: RunProfile, inputs: TrainingInputs) -> list[str]:
    return [*entrypoint(profile), *render_overrides(verl_settings(profile, inputs))]
