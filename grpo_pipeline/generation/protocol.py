"""What generating means in this project, at its two levels, for rollouts and evaluation alike:

    .venv/bin/python -m pytest -q tests/test_evaluate.py -k native   # both decoders behind one protocol

`TokenGenerator`: a loaded model's batch of token-id prompts -> each prompt's completion token ids
(nanochat's `Engine.generate_batch`, which serves RL rollouts and pass@k evaluation alike). The native
decoder (generation/decoding.py) and transformers' `generate` (generation/batches.py) both answer it;
the local backend's rollouts call it inside TRL (backends/local/rollouts.py), the evaluation's
transformers engine (generation/engines.py) per batch of prompts.

`Generate`: a model directory and chat prompts -> `samples_per_prompt` `Response`s per prompt, in
prompt order: what an engine (transformers, vLLM, sharded over Ray tasks, on a cluster's nodes) gives
the evaluation stage, which scores them (stages/evaluate.py). Tests stand a known model in here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, Field

from grpo_pipeline.generation.plan import GenerationPlan

if TYPE_CHECKING:
    from grpo_pipeline.generation.decode_step import Sampling
    from grpo_pipeline.generation.decoding import Generated


class TokenGenerator(Protocol):
    def reserve(self, rows: int, length: int) -> None:
        """Size what generating `rows` sequences of `length` positions needs now (a cache), once."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling) -> Generated:
        """Up to `max_new_tokens` tokens for each prompt (token ids), stopping at end-of-sequence."""


class GenerationSettings(BaseModel):
    """How one batch of chat prompts is generated: the run's `GenerationPlan` and the sampling."""

    plan: GenerationPlan = Field(default_factory=GenerationPlan, description="The run's generation path "
                                 "(generation/plan.py), resolved once at planning.")
    samples_per_prompt: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 64
    batch_size: int = 32
    seed: int = 0
    dtype: str = Field("float32", description="Dtype of the model while generating.")
    tensor_parallel_size: int = Field(1, description="Devices one vLLM engine spans (cluster evaluation).")
    max_prompt_length: int | None = Field(None, description="Longest prompt expected (`data.max_prompt_length`): "
                                          "the native decoder's cache is sized for it once.")
    compile_cache_dir: str | None = Field(None, description="Where compiled decode steps are kept between runs.")
    label: str | None = Field(None, description="What is generating, for a person watching (`base`, `trained`); "
                              "empty: the model directory's name.")

    @property
    def torch_device(self) -> str:
        return self.plan.torch_device

    def on_device(self, torch_device: str, dtype: str) -> GenerationSettings:
        """The same settings where a node's torch finds its device (a cluster node without one: the CPU)."""
        return self.model_copy(update={"plan": self.plan.model_copy(update={"torch_device": torch_device}),
                                       "dtype": dtype})


class Response(BaseModel):
    text: str
    tokens: int = Field(..., description="Generated tokens, end-of-sequence excluded.")
    truncated: bool = Field(..., description="Stopped by max_new_tokens, not by the model.")


# (model_dir, prompts as chat messages, settings) -> samples_per_prompt responses per prompt, in order.
# An engine's `where` attribute (if any) says where it runs, for the evaluation's report.
Generate = Callable[[Path, list[list[dict]], GenerationSettings], list[list[Response]]]
