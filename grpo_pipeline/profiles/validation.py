"""Rules that involve several fields of a profile and hold for any backend, checked before anything
expensive starts: lengths, the dist checkpoint's converter, generation settings, the rewards a user brings (profiles/rewards.py), the evaluation asked for
(profiles/evaluation.py).

The layout rules (Megatron's and vLLM's parallel layouts, batches over data-parallel ranks) are the
planner's (planner/rules.py); each backend picks those that apply to it (`Backend.profile_problems`),
and the plan step (stages/plan.py `checked_profile`) reports them together with these, on one line.
Each message names the field, its value and a fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_pipeline.common.errors import ProfileError
from grpo_pipeline.profiles.datasets import mapping_problems
from grpo_pipeline.profiles.evaluation import eval_problems
from grpo_pipeline.profiles.rewards import reward_problems

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile


def length_problems(p: RunProfile) -> list[str]:
    d, r = p.data, p.rollout
    needed = d.max_prompt_length + d.max_response_length
    if r.max_model_len is not None and r.max_model_len < needed:
        return [
            f"rollout.max_model_len={r.max_model_len}: shorter than data.max_prompt_length "
            f"{d.max_prompt_length} + data.max_response_length {d.max_response_length} = {needed}; "
            f"set rollout.max_model_len >= {needed}"
        ]
    return []


def position_problems(p: RunProfile) -> list[str]:
    """A prompt and its response (training's and the evaluation's) past the positions the model
    covers: generation would allocate for, and then fail at, lengths the model cannot encode."""
    d, limit = p.data, p.model.architecture.max_position_embeddings
    if limit is None:
        return []
    problems = []
    for field, response in (("data.max_response_length", d.max_response_length),
                            ("eval.max_new_tokens", p.eval.max_new_tokens)):
        if response is not None and d.max_prompt_length + response > limit:
            room = limit - d.max_prompt_length
            problems.append(f"{field}={response}: data.max_prompt_length {d.max_prompt_length} + {response} = "
                            f"{d.max_prompt_length + response} tokens, more than the model's max_position_embeddings "
                            f"{limit}; " + (f"set {field} <= {room}" if room > 0 else
                                            f"lower data.max_prompt_length below {limit}"))
    return problems


def head_problems(p: RunProfile) -> list[str]:
    """Grouped-query attention shares each KV head among a whole number of query heads."""
    arch = p.model.architecture
    if arch.num_attention_heads % arch.num_kv_heads:
        return [f"model.architecture.num_kv_heads={arch.num_kv_heads}: the {arch.num_attention_heads} attention heads "
                "do not split into groups of one KV head each (num_attention_heads must be a multiple of "
                "num_key_value_heads); give the model's own config.json"]
    return []


def sampling_problems(p: RunProfile) -> list[str]:
    """Sampling settings no backend can run: GRPO's advantage is a reward against the others of its
    group (TRL refuses a group of one, and verl's advantage of one is its raw reward); greedy
    evaluation gives one answer however many are asked for."""
    problems = []
    if p.algorithm.rollout_n < 2:
        problems.append(f"algorithm.rollout_n={p.algorithm.rollout_n}: GRPO scores each response against the others "
                        "sampled for its prompt, so a group needs at least 2; set algorithm.rollout_n >= 2")
    e = p.eval
    if e.samples_per_prompt > 1 and e.temperature == 0:
        problems.append(f"eval.samples_per_prompt={e.samples_per_prompt} with eval.temperature=0: greedy decoding "
                        "gives the same response every time; set eval.temperature > 0 (e.g. 0.6) or "
                        "eval.samples_per_prompt=1")
    return problems


def generation_problems(p: RunProfile) -> list[str]:
    """Generation settings that cannot work together or here."""
    import importlib.util

    g, problems = p.generation, []
    if g.compile and g.cache != "static":
        problems.append("generation.compile=true needs generation.cache=static (a compiled decode step needs a "
                        "fixed-size KV cache); set both, or generation.compile=false")
    if g.engine == "vllm" and not p.platform.accelerated:
        problems.append(f"generation.engine=vllm on device {p.platform.kind}: vLLM needs a GPU or NPU; use "
                        "generation.engine=auto")
    elif g.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("generation.engine=vllm: vllm is not installed here; install it (vllm-ascend on NPUs) or use "
                        "generation.engine=auto")
    return problems


def conversion_problems(p: RunProfile) -> list[str]:
    """A dist checkpoint asked for a model the converter cannot write (common/dist_checkpoint.py)."""
    if p.model.dist_checkpoint and p.model.architecture.linear_num_key_heads:
        return [
            f"model.dist_checkpoint=true: {p.model.name} has Gated DeltaNet (linear attention) layers, which "
            "the converter does not write yet; set model.dist_checkpoint=false (verl's bridge loads the HF "
            "weights directly)"
        ]
    return []


def profile_problems(p: RunProfile) -> list[str]:
    """Every rule of this module: the ones that hold for any backend."""
    return [*length_problems(p), *conversion_problems(p), *generation_problems(p), *reward_problems(p.reward),
            *mapping_problems(p.data), *eval_problems(p.eval), *position_problems(p), *head_problems(p),
            *sampling_problems(p)]


def refuse(problems: list[str]) -> None:
    """All problems of a profile, on one line (ProfileError); nothing when there are none."""
    if problems:
        raise ProfileError("invalid profile: " + "; ".join(problems))


def validate_profile(p: RunProfile) -> None:
    """The rules that hold for any backend (the backend's own are added where plans are checked)."""
    refuse(profile_problems(p))
