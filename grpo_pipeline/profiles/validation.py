"""Rules that involve several fields of a profile and hold for any backend, checked before anything
expensive starts: lengths, the dist checkpoint's converter, generation settings, the rewards a user
brings (the `reward` section, profiles/rewards.py: each file read and parsed, never run), the evaluation
asked for (profiles/evaluation.py).

The layout rules (Megatron's and vLLM's parallel layouts, batches over data-parallel ranks) are the
planner's (planner/rules.py); each backend picks those that apply to it (`Backend.profile_problems`),
and the plan step (stages/plan.py `checked_profile`) reports them together with these, on one line.
Each message names the field, its value and a fix.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_pipeline.errors import ProfileError, headline_and_details
from grpo_pipeline.profiles.datasets import mapping_problems
from grpo_pipeline.profiles.evaluation import eval_problems
from grpo_pipeline.profiles.rewards import RewardSection
from grpo_pipeline.profiles.secrets import is_secret, parse_reference

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
    """A dist checkpoint asked for a model the converter cannot write (checkpoints/convert.py)."""
    if p.model.dist_checkpoint and p.model.architecture.linear_num_key_heads:
        return [
            f"model.dist_checkpoint=true: {p.model.name} has Gated DeltaNet (linear attention) layers, which "
            "the converter does not write yet; set model.dist_checkpoint=false (verl's bridge loads the HF "
            "weights directly)"
        ]
    return []


# A reward file is a module of a few functions; anything larger is not one.
MAX_REWARD_FILE_BYTES = 1 << 20


def reward_problems(section: RewardSection) -> list[str]:
    """What in the profile's `reward` section (profiles/rewards.py) training would fail on minutes in, found
    without running it: each file is read (bounded) and parsed, never run; planning executes no user code
    here (rewards/check.py runs it in a child process, once the data is there)."""
    problems = [problem for function in section.functions if (problem := _file_problem(function.path))]
    if section.url is not None and not section.url.startswith(("http://", "https://")):
        problems.append(f"reward.url={section.url!r}: a reward server is reached over http:// or https://")
    if section.token is not None and parse_reference(section.token) is None:
        problems.append("reward.token: only a reference `${NAME}` to a variable of the environment is taken (the value "
                        "would be stored in the run's profile); export the token and set reward.token='${NAME}'")
    if section.token is not None and section.url is None:
        problems.append("reward.token is set without reward.url; set the server's URL or drop the token")
    if section.token is not None and section.url and _clear_text_off_host(section.url):
        problems.append(f"reward.url={section.url!r} with reward.token: the bearer token would cross the network "
                        "unencrypted over http://; use https:// (http:// only to this host: 127.0.0.1, localhost, ::1)")
    weights = [f.weight for f in section.functions] + ([section.weight] if section.url else [])
    if weights and max(weights) <= 0:
        # Full marks are the positive weights' sum: with none, every response would count as correct.
        problems.append(f"reward weights {weights}: no reward has a weight above 0, so no response can be told "
                        "correct (accuracy, pass@k and eval.checkpoints=best count full marks); give one reward a "
                        "positive weight")
    return problems


def _clear_text_off_host(url: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.scheme == "http" and (parts.hostname or "") not in ("127.0.0.1", "localhost", "::1")


def _file_problem(spec: str) -> str | None:
    where = f"reward function {spec!r}"
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier():
        return f"{where}: expected /path/to/file.py:function"
    file = Path(path).expanduser()
    try:
        if not file.is_file():
            return f"{where}: {path} is not a file; give the path of a Python file that every node can read"
        with open(file, "rb") as handle:
            source = handle.read(MAX_REWARD_FILE_BYTES + 1)
    except OSError as exc:
        return f"{where}: cannot read {path} ({exc.strerror or exc})"
    if len(source) > MAX_REWARD_FILE_BYTES:
        return f"{where}: {path} is larger than {MAX_REWARD_FILE_BYTES >> 10} KiB; a reward file is a small Python module"
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:
        line = f" line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        return f"{where}: {path}{line} is not valid Python ({getattr(exc, 'msg', exc)}); fix it"
    if name not in _top_level_names(tree):
        return f"{where}: {path} defines no {name!r} at its top level; name the reward function it defines"
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def public_env_problems(p: RunProfile) -> list[str]:
    """`public_env` names env entries read by reference, and never one named like a secret."""
    problems = []
    for name in p.public_env:
        if name not in p.env:
            problems.append(f"public_env: {name} is no env entry of the profile; add env.{name}=${{NAME}} or remove it")
        elif is_secret(name):
            problems.append(f"public_env: env.{name} is named like a secret, which is never shown; rename the entry, "
                            "or remove it from public_env")
    return problems


def profile_problems(p: RunProfile) -> list[str]:
    """Every rule of this module: the ones that hold for any backend."""
    return [*public_env_problems(p), *length_problems(p), *conversion_problems(p), *generation_problems(p),
            *reward_problems(p.reward), *mapping_problems(p.data), *eval_problems(p.eval), *position_problems(p),
            *head_problems(p), *sampling_problems(p)]


def refuse(problems: list[str]) -> None:
    """All problems of a profile (ProfileError): the first with its fix as the headline, the others on
    lines of their own below it; nothing when there are none."""
    if problems:
        raise ProfileError(headline_and_details(problems, "invalid profile: "))


def validate_profile(p: RunProfile) -> None:
    """The rules that hold for any backend (the backend's own are added where plans are checked)."""
    refuse(profile_problems(p))
