"""The profile's `lora` section: train a low-rank adapter (PEFT's LoRA) instead of every weight.

    python -m grpo_pipeline --model tiny --device cpu --set lora.rank=16 --dry-run

One section drives both backends: the local backend hands it to TRL as a `peft.LoraConfig`
(backends/local/lora.py), the verl backend renders verl 0.9.1's keys of its FSDP engine
(`actor_rollout_ref.model.lora_rank`, `lora_alpha`, `target_modules`: backends/verl/command.py). The
target modules are checked against the model's own module names while the run is planned
(planner/lora.py); the reference policy is the base model with the adapter disabled, never a second
copy of the weights.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from grpo_pipeline.profiles.section import MAX_WIDTH, Section

ALL_LINEAR = "all-linear"  # PEFT's (and verl's) word for every linear layer but the output layer


class LoraSection(Section):
    """A LoRA adapter on the policy; `rank: 0` trains every weight (full fine-tuning)."""

    rank: int = Field(
        0, ge=0, le=MAX_WIDTH, description="LoRA rank r of each adapted weight (W + alpha/r x B A, A: r x in, B: out x r); "
        "0: no adapter, every weight trains. 16-64 is usual; verl's guide recommends 32 or more for small models.")
    alpha: int = Field(
        32, gt=0, le=MAX_WIDTH, description="LoRA's alpha: the adapter's update is scaled by alpha / rank (a whole "
        "number, as PEFT and verl take it).")
    target_modules: list[str] | str = Field(
        ALL_LINEAR, description="Which modules get an adapter: `all-linear` (every linear layer except the output "
        "layer), or a list of module names as the model names them (`[q_proj, k_proj, v_proj, o_proj]`: a name matches "
        "a module whose name ends with it, as in PEFT). Checked against the model's modules at planning.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (local backend; verl 0.9.1's FSDP "
        "engine takes none).")

    @field_validator("target_modules")
    @classmethod
    def some_target(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str) and value != ALL_LINEAR:
            raise ValueError(f"a single name must be `{ALL_LINEAR}`; write a list for module names: '[{value}]'")
        if isinstance(value, list) and (not value or any(not name.strip() for name in value)):
            raise ValueError(f"name at least one module, or `{ALL_LINEAR}`")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def describe(self) -> str:
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        return f"LoRA rank {self.rank}, alpha {self.alpha}, on {targets}" + (
            f", dropout {self.dropout:g}" if self.dropout else "")
