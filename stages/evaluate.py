"""The `evaluate` stage: generate on the validation split and score with the training reward.

    python -m flows.grpo --model tiny --device cpu --stages evaluate --set 'eval.models=[/path/a,/path/b]'

For each model directory: responses to every validation prompt (`eval.samples_per_prompt` each),
scored by `common/rewards.py` as in training; per-sample results go to `<out>/<name>.jsonl` and the
metrics (mean reward with a bootstrap 95% interval, accuracy, format rate, pass@k, response length
mean / p95, truncation rate) are computed from exactly those records.

Generation happens at one boundary, `Generate(model_dir, prompts, settings) -> responses`, so the
engine can change and tests can stand in a known model. Engines: vLLM (`vllm` / `vllm-ascend`) when
it is importable and the device is a GPU or NPU; otherwise the transformers model, batched, decoded by
the rollouts' native decoder or by `generate` (`generation.decoder`, generation/batches.py). With
several accelerators the prompts are split into contiguous shards, one Ray task per device, and the
results are put back in prompt order.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from profiles.engine import native_path, transformers_path
from profiles.errors import UserError
from profiles.platform import Platform
from profiles.schema import RunProfile
from backends.metrics import METRICS
from generation.decoding import compile_cache_dir
from common.files import write_text_atomic
from common.progress import Bar

BOOTSTRAP_RESAMPLES = 1000


class EvalSettings(BaseModel):
    samples_per_prompt: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 64
    batch_size: int = 32
    max_prompts: int | None = None
    seed: int = 0
    reward_function: str | None = None
    torch_device: str = Field("cpu", description="Where generation runs (the platform's torch device).")
    dtype: str = Field("float32", description="Dtype of the model while generating.")
    tensor_parallel_size: int = Field(1, description="Devices one vLLM engine spans (cluster evaluation).")
    cache: str = Field("dynamic", description="KV cache of transformers' generate (`generation.cache`).")
    compile: bool = Field(False, description="Compiled decode step (`generation.compile`).")
    attn_implementation: str = Field("sdpa", description="Attention kernels (`generation.attn_implementation`).")
    decoder: str = Field("generate", description="`native` or `generate` (`generation.decoder` on this device).")
    max_prompt_length: int | None = Field(None, description="Longest prompt expected (`data.max_prompt_length`): "
                                          "the native decoder's cache is sized for it once.")
    compile_cache_dir: str | None = Field(None, description="Where compiled decode steps are kept between runs.")

    @classmethod
    def from_profile(cls, profile: RunProfile) -> EvalSettings:
        section = profile.eval
        if section.samples_per_prompt > 1 and section.temperature == 0:
            raise UserError(
                f"eval.samples_per_prompt={section.samples_per_prompt} with eval.temperature=0: greedy decoding "
                "gives the same response every time; set eval.temperature (e.g. 1.0) or one sample per prompt"
            )
        return cls(
            samples_per_prompt=section.samples_per_prompt, temperature=section.temperature,
            max_new_tokens=section.max_new_tokens or profile.data.max_response_length, batch_size=section.batch_size,
            max_prompts=section.max_prompts, seed=section.seed, reward_function=profile.algorithm.reward_function,
            torch_device=profile.platform.torch_device, dtype=profile.platform.run_dtype(profile.engine.dtype),
            cache=profile.generation.cache, compile=profile.generation.compile,
            attn_implementation=profile.generation.attn_implementation,
            decoder=profile.generation.resolved_decoder(profile.platform.torch_device),
            max_prompt_length=profile.data.max_prompt_length,
            compile_cache_dir=str(compile_cache_dir(profile.model.root)),
        )

    def transformers_path(self) -> str:
        if self.decoder == "native":
            return native_path(self.compile, self.torch_device)
        return transformers_path(self.cache, self.compile, self.attn_implementation)


class Response(BaseModel):
    text: str
    tokens: int = Field(..., description="Generated tokens, end-of-sequence excluded.")
    truncated: bool = Field(..., description="Stopped by max_new_tokens, not by the model.")


# (model_dir, prompts as chat messages, settings) -> samples_per_prompt responses per prompt, in order
Generate = Callable[[Path, list[list[dict]], EvalSettings], list[list[Response]]]


class ModelMetrics(BaseModel):
    name: str
    path: str
    prompts: int
    samples: int
    mean_reward: float
    reward_ci95: tuple[float, float] = Field(..., description="Bootstrap 95% interval of the mean reward (over prompts).")
    accuracy: float
    format_rate: float
    pass_at_k: float
    k: int
    response_length_mean: float
    response_length_p95: float
    truncation_rate: float
    samples_file: str
    generation_s: float | None = Field(None, description="Seconds spent generating the responses (model load included).")
    generated_tokens: int | None = Field(None, description="Tokens generated, end-of-sequence excluded.")

    def summary_line(self) -> str:
        """The model's results in one line, as the flow logs them and the command line prints them."""
        generated = "" if self.generation_s is None else \
            f", generated {self.generated_tokens} tokens in {self.generation_s:.1f} s ({self.tokens_per_s():,.0f} tokens/s)"
        return (f"{self.name}: mean reward {self.mean_reward:.3f} [{self.reward_ci95[0]:.3f}, {self.reward_ci95[1]:.3f}], "
                f"accuracy {self.accuracy:.3f}, format {self.format_rate:.3f}, pass@{self.k} {self.pass_at_k:.3f}, "
                f"length {self.response_length_mean:.1f} (p95 {self.response_length_p95:.0f}), truncated "
                f"{self.truncation_rate:.3f} on {self.prompts} prompts{generated} ({self.samples_file})")

    def tokens_per_s(self) -> float:
        return (self.generated_tokens or 0) / self.generation_s if self.generation_s else 0.0


class EvalReport(BaseModel):
    val_file: str
    engine: str
    models: list[ModelMetrics]
    generation: str | None = Field(None, description="Generation time of each model, beside the rollouts' when the "
                                   "run trained (its metrics file).")


def load_validation(val_file: Path, max_prompts: int | None) -> list[dict]:
    """Validation rows: prompt, data_source, ground truth; a clear error for a file that cannot be scored."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(val_file)
    except (OSError, ValueError) as exc:
        raise UserError(f"{val_file}: not a readable parquet file ({exc})") from exc
    missing = [c for c in ("prompt", "data_source", "reward_model") if c not in table.column_names]
    if missing:
        raise UserError(f"{val_file}: no {', '.join(missing)} column(s): validation rows need prompt, data_source and "
                        "reward_model.ground_truth (verl's RL schema)")
    rows = table.select(["prompt", "data_source", "reward_model"]).to_pylist()[: max_prompts or None]
    if not rows:
        raise UserError(f"{val_file}: the validation split is empty")
    for index, row in enumerate(rows):
        truth = (row["reward_model"] or {}).get("ground_truth")
        if truth in (None, ""):
            raise UserError(f"{val_file}: row {index} has no reward_model.ground_truth")
        row["ground_truth"] = str(truth)
    return rows


def transformers_generate(model_dir: Path, prompts: list[list[dict]], settings: EvalSettings) -> list[list[Response]]:
    """Batched generation with the transformers model, `eval.batch_size` prompts at a time: the
    native decoder (`generation.decoder: native`, a Llama-family model), else `generate`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation.decoding import unsupported
    from generation.batches import generate_batches, native_batches

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings.dtype),
                                                 attn_implementation=settings.attn_implementation)
    model = model.to(settings.torch_device).eval()
    stop_ids = set(_as_list(model.generation_config.eos_token_id) + [tokenizer.eos_token_id]) - {None}
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    native = settings.decoder == "native" and unsupported(model) is None
    batches = native_batches(model, tokenizer, texts, settings, sorted(stop_ids)) if native else \
        generate_batches(model, tokenizer, texts, settings)
    torch.manual_seed(settings.seed)
    responses: list[list[Response]] = []
    with Bar(total=len(texts), desc=f"generate {model_dir.name}", unit="prompt") as bar:
        for new in batches:
            for offset in range(0, len(new), settings.samples_per_prompt):
                group = []
                for ids in new[offset : offset + settings.samples_per_prompt]:
                    ended = next((i for i, t in enumerate(ids) if t in stop_ids), None)
                    kept = ids if ended is None else ids[:ended]
                    group.append(Response(text=tokenizer.decode(kept, skip_special_tokens=True), tokens=len(kept),
                                          truncated=ended is None))
                responses.append(group)
            bar.update(len(new) // settings.samples_per_prompt)
    return responses


def vllm_generate(model_dir: Path, prompts: list[list[dict]], settings: EvalSettings) -> list[list[Response]]:
    """vLLM's offline engine: the chat template applied by vLLM, n samples per prompt, results in
    prompt order; a response cut by max_tokens reports finish_reason "length"."""
    from vllm import LLM, SamplingParams

    engine = LLM(model=str(model_dir), seed=settings.seed, tensor_parallel_size=settings.tensor_parallel_size)
    params = SamplingParams(n=settings.samples_per_prompt, temperature=settings.temperature,
                            max_tokens=settings.max_new_tokens, seed=settings.seed)
    outputs = engine.chat(prompts, params, use_tqdm=False)
    return [
        [Response(text=c.text, tokens=len(c.token_ids), truncated=c.finish_reason == "length") for c in output.outputs]
        for output in outputs
    ]


def choose_engine(platform: Platform, devices: int, engine: str = "transformers") -> Generate:
    """`engine` (`generation.engine` as resolved here: vllm or transformers), sharded over the devices."""
    generate = vllm_generate if engine == "vllm" else transformers_generate
    return sharded(generate, devices, platform) if platform.accelerated and devices > 1 else generate


def generate_on_node(model_dir: Path, prompts: list[list[dict]], settings: EvalSettings) -> tuple[str, list[list[Response]]]:
    """On a cluster node, inside a Ray task that holds its devices: the engine the node's image has
    (vLLM / vllm-ascend, else transformers on the device the node's torch sees), and its name."""
    import importlib.util
    import socket

    if importlib.util.find_spec("vllm"):
        return f"vllm on {socket.gethostname()}", vllm_generate(model_dir, prompts, settings)
    device = _node_torch_device(settings.torch_device)
    if device != settings.torch_device:
        print(f"{socket.gethostname()}: Ray offers this task an accelerator, but torch here sees no "
              f"{settings.torch_device} device: generating on the CPU", flush=True)
        settings = settings.model_copy(update={"torch_device": "cpu", "dtype": "float32"})
    return f"transformers ({device}) on {socket.gethostname()}", transformers_generate(model_dir, prompts, settings)


def _node_torch_device(wanted: str) -> str:
    import torch

    if wanted == "npu":
        try:
            import torch_npu  # noqa: F401

            return "npu" if torch.npu.is_available() else "cpu"
        except Exception:  # not installed, or the Ascend toolkit not loaded
            return "cpu"
    return wanted if wanted == "cpu" or torch.cuda.is_available() else "cpu"


def on_cluster(platform: Platform, replicas: int, devices_each: int, ray_address: str | None,
               runtime_env: dict, check_nodes: Callable[[], None] | None = None) -> Generate:
    """Generation for a model too big for the flow's host: `replicas` Ray tasks on the cluster's
    accelerator nodes, each holding `devices_each` devices (the engine's tensor parallel size) and
    a contiguous range of the prompts; results merged in prompt order. The project's code travels
    with the job (`connect_ray`), so a node needs only its engine, not this package. `check_nodes`
    runs once, connected, before the first task is sent (the backend's preflight)."""
    unchecked = [check_nodes] if check_nodes else []

    def generate_on_cluster(model_dir: Path, prompts: list[list[dict]], settings: EvalSettings) -> list[list[Response]]:
        import ray

        from common.ray_cluster import connect_ray

        connect_ray(ray_address, runtime_env)
        while unchecked:
            unchecked.pop()()
        run = ray.remote(**platform.ray_task_options(devices=devices_each))(generate_on_node)
        size = math.ceil(len(prompts) / replicas)
        results = ray.get([run.remote(model_dir, prompts[start : start + size], settings)
                           for start in range(0, len(prompts), size)])
        engines = sorted({engine for engine, _ in results})
        generate_on_cluster.__name__ = f"{', '.join(engines)} ({len(results)} Ray tasks on the cluster)"
        return [group for _, piece in results for group in piece]

    generate_on_cluster.__name__ = f"the cluster's engine ({replicas} Ray tasks)"
    return generate_on_cluster


def sharded(generate: Generate, shards: int, platform: Platform) -> Generate:
    """`generate` over `shards` Ray tasks (one device each), contiguous prompt ranges, merged in order."""

    def generate_sharded(model_dir: Path, prompts: list[list[dict]], settings: EvalSettings) -> list[list[Response]]:
        import ray

        from common.ray_cluster import connect_ray

        connect_ray(None, None)
        run = ray.remote(**platform.ray_task_options())(generate)
        size = math.ceil(len(prompts) / shards)
        pieces = [prompts[start : start + size] for start in range(0, len(prompts), size)]
        results = ray.get([run.remote(model_dir, piece, settings) for piece in pieces])
        return [group for piece in results for group in piece]

    generate_sharded.__name__ = f"{getattr(generate, '__name__', 'engine')} x {shards} Ray workers"
    return generate_sharded


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def evaluate_model(
    name: str, model_dir: Path, rows: list[dict], settings: EvalSettings, out_dir: Path,
    generate: Generate = transformers_generate,
) -> ModelMetrics:
    from common.rewards import score

    started = time.perf_counter()
    responses = generate(model_dir, [row["prompt"] for row in rows], settings)
    generation_s = time.perf_counter() - started
    if len(responses) != len(rows) or any(len(r) != settings.samples_per_prompt for r in responses):
        raise RuntimeError(f"the engine returned {len(responses)} groups for {len(rows)} prompts")
    samples = []
    for index, (row, group) in enumerate(zip(rows, responses)):
        for sample, response in enumerate(group):
            result = score(row["data_source"], response.text, row["ground_truth"], settings.reward_function)
            samples.append({
                "prompt_index": index, "sample": sample, "data_source": row["data_source"],
                "prompt": row["prompt"][-1]["content"], "response": response.text, "ground_truth": row["ground_truth"],
                "reward": result.reward, "correct": result.correct, "formatted": result.formatted,
                "response_tokens": response.tokens, "truncated": response.truncated,
            })
    samples_file = out_dir / f"{name}.jsonl"
    write_text_atomic(samples_file, "".join(json.dumps(s) + "\n" for s in samples))
    return ModelMetrics(name=name, path=str(model_dir), samples_file=str(samples_file), generation_s=round(generation_s, 2),
                        generated_tokens=sum(s["response_tokens"] for s in samples),
                        **metrics_from_samples(samples, settings.samples_per_prompt, settings.seed))


def metrics_from_samples(samples: list[dict], k: int, seed: int = 0) -> dict[str, Any]:
    """The metrics of a per-sample file: everything a report states is computed from these records."""
    by_prompt: dict[int, list[dict]] = {}
    for sample in samples:
        by_prompt.setdefault(sample["prompt_index"], []).append(sample)
    prompt_means = [statistics.fmean(s["reward"] for s in group) for group in by_prompt.values()]
    lengths = sorted(s["response_tokens"] for s in samples)
    return {
        "prompts": len(by_prompt),
        "samples": len(samples),
        "mean_reward": statistics.fmean(s["reward"] for s in samples),
        "reward_ci95": bootstrap_ci(prompt_means, seed),
        "accuracy": statistics.fmean(s["correct"] for s in samples),
        "format_rate": statistics.fmean(s["formatted"] for s in samples),
        "pass_at_k": statistics.fmean(pass_at_k(len(g), sum(s["correct"] for s in g), k) for g in by_prompt.values()),
        "k": k,
        "response_length_mean": statistics.fmean(lengths),
        "response_length_p95": lengths[min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)],
        "truncation_rate": statistics.fmean(s["truncated"] for s in samples),
    }


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of k of the n samples is correct (the unbiased estimator)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def bootstrap_ci(values: list[float], seed: int, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling prompts with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def evaluate(
    models: dict[str, Path], val_file: Path, settings: EvalSettings, out_dir: Path,
    generate: Generate = transformers_generate,
) -> EvalReport:
    from stages.model import verify_hf_dir

    for name, path in models.items():
        verify_hf_dir(path)  # a directory without weights fails here, before any generation
    rows = load_validation(val_file, settings.max_prompts)
    results = [evaluate_model(name, path, rows, settings, out_dir, generate) for name, path in models.items()]
    # named after generating: an engine on the cluster says then which engine its nodes had
    engine = getattr(generate, "__name__", "custom")
    if "transformers" in engine:
        engine += f" ({settings.transformers_path()})"
    return EvalReport(val_file=str(val_file), engine=engine, models=results,
                      generation=generation_summary(results, out_dir.parent / METRICS))


def generation_summary(models: list[ModelMetrics], metrics_file: Path) -> str | None:
    """The evaluation's generation time per model beside the rollouts' (generation_s of the steps in
    the run's metrics file, when it trained), for the log and the report."""
    from backends.metrics import read_metrics

    parts = [f"evaluation of {m.name} {m.generation_s:.1f} s ({m.tokens_per_s():,.0f} tokens/s)"
             for m in models if m.generation_s is not None]
    rounds = [r.generation_s for r in read_metrics(metrics_file) if r.generation_s]
    if rounds:
        parts.insert(0, f"rollouts {sum(rounds):.1f} s in {len(rounds)} generation rounds "
                        f"({sum(rounds) / len(rounds):.1f} s a round)")
    return "; ".join(parts) or None
