"""The one place the generation path of a run is decided: `plan_generation(profile)` turns the
profile's `generation` section (and `auto`) into a `GenerationPlan`, once, while the run is planned.

    python -m grpo_pipeline --model tiny --device cpu --dry-run | jq .generation   # the plan, in the dry run

The plan travels with the run: the dry run shows it, the train stage hands it to the backend (the local
backend's GRPOConfig fields and its workers read it: vLLM, the native decoder or TRL's `generate`), and
the evaluation stage's settings carry it to the engine (generation/engines.py). Nothing downstream
resolves `auto` again or tells engines apart by name; a worker that finds its model outside the native
decoder's family falls back to `generate` and says so (a fact of the model, not a second decision).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile


class GenerationPlan(BaseModel):
    """How rollouts and evaluation generate on this run, resolved: no `auto` left."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["transformers", "vllm"] = Field("transformers", description="The inference engine.")
    decoder: Literal["native", "generate"] | None = Field(
        "generate", description="How the transformers engine decodes: the native decoder or transformers' `generate` "
        "(none under vLLM).")
    cache: Literal["dynamic", "static"] = Field("dynamic", description="KV cache of `generate`.")
    compile: bool = Field(False, description="Compiled decode step.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field("sdpa", description="Attention kernels.")
    torch_device: str = Field("cpu", description="Where the transformers engine runs (the platform's torch device).")
    steps_per_generation: int = Field(1, gt=0, description="GRPO steps whose prompts one rollout round generates.")

    @property
    def native(self) -> bool:
        return self.engine == "transformers" and self.decoder == "native"

    def path(self) -> str:
        """How one batch is generated, in words (the rollouts and the evaluation say it alike)."""
        if self.engine == "vllm":
            return "vLLM (colocate)"
        if self.native:
            step = ("compiled" if self.compile else "eager") + (
                " step captured in a CUDA graph" if self.torch_device == "cuda" else " step")
            return f"native decoding (static KV cache, {step}, sampling on the device; Llama-family models)"
        return f"transformers generate ({self.generate_path()})"

    def generate_path(self) -> str:
        """How transformers' `generate` runs, in words."""
        return f"{self.cache} cache, {'compiled' if self.compile else 'eager'} decoding, {self.attn_implementation} attention"

    def with_rounds_of(self, profile: RunProfile) -> GenerationPlan:
        """This plan with the rounds `profile` has: the one field the layer of the devices found may set (the local
        backend's rollouts beside its step: backends/local/sizing.py)."""
        return self.model_copy(update={"steps_per_generation": profile.generation.steps_per_generation})

    def describe(self) -> str:
        """The rollouts' path, as the train stage's log and the report give it."""
        return f"{self.path()}, {self.steps_per_generation} step(s)' prompts per generation"


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def plan_generation(profile: RunProfile) -> GenerationPlan:
    """The run's generation path: `generation.engine: auto` is vLLM when it is importable on a GPU or
    NPU (vllm-ascend), else transformers; `generation.decoder: auto` is the native decoder on CUDA
    GPUs, `generate` elsewhere. profiles/validation.py has already refused what cannot work here."""
    section, platform = profile.generation, profile.platform
    engine = section.engine
    if engine == "auto":
        engine = "vllm" if platform.accelerated and vllm_importable() else "transformers"
    decoder = section.decoder
    if decoder == "auto":
        decoder = "native" if platform.torch_device == "cuda" else "generate"
    return GenerationPlan(
        engine=engine, decoder=None if engine == "vllm" else decoder, cache=section.cache, compile=section.compile,
        attn_implementation=section.attn_implementation, torch_device=platform.torch_device,
        steps_per_generation=section.steps_per_generation,
    )


def steps_per_round(profile: RunProfile) -> int:
    """The GRPO steps whose prompts one rollout round generates (the plan's `steps_per_generation`), for
    the rules that size a round before the plan is made (backends/local/rollout_memory.py)."""
    return profile.generation.steps_per_generation
