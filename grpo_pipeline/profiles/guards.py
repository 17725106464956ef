"""The profile's `guards` section: the silent failures that stop a run, each on by default, each `off`-able.

    python -m grpo_pipeline --model tiny --device cpu --set guards.rollout_mismatch=off

What each guard watches and how it stops a run is backends/guards.py; this is only what a person sets.
A threshold guard takes its number or `off`, the others `stop` or `off` (a YAML `off` / `false`, which
`--set` reads as a boolean, means `off` too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from grpo_pipeline.profiles.section import MAX_SEQUENCES, Section

Off = Literal["off"]
StopOrOff = Literal["stop", "off"]
Positive = Annotated[float, Field(gt=0)]
Steps = Annotated[int, Field(gt=0, le=MAX_SEQUENCES)]


class GuardsSection(Section):
    """Checks of every training step, on both backends, that stop the run with one line naming the step,
    the numbers and the likely cause (docs/guards.md)."""

    rollout_mismatch: Positive | Off = Field(
        0.05, description="Stop when the rollout engine's log-probs and the trainer's for the same tokens "
        "under the same weights differ by more than this (KL per token, k3 estimator: verl's "
        "`rollout_corr/k3_kl`) for `rollout_mismatch_steps` steps in a row: the rollouts are not using the trained "
        "weights. A healthy run stays near 0 in fp32 and below 0.01 in bf16; `off` only records it.")
    rollout_mismatch_steps: int = Field(3, gt=0, le=MAX_SEQUENCES, description="Steps in a row above "
                                        "`rollout_mismatch` that stop the run.")
    probe_sequences: int = Field(
        4, ge=0, le=MAX_SEQUENCES, description="Local backend: rollout sequences of each generation round (per "
        "worker) whose log-probs the trainer computes again for the mismatch (one extra forward pass of these); "
        "0: no probe, the mismatch is not measured.")
    reward_collapse_steps: Steps | Off = Field(
        10, description="Stop when every group's rewards were constant (zero advantage "
        "everywhere: nothing is learned) for this many steps in a row, or the mean reward was exactly 0 in each of "
        "the first this many steps (a reward that never scores); `off`: never. Raise it for a run expected to "
        "start at zero reward for longer.")
    non_finite: StopOrOff = Field(
        "stop", description="Stop at once on a NaN or infinite loss, gradient norm, reward or log-prob, keeping "
        "the last good checkpoint: the local backend saves nothing after it; a verl step saved before its "
        "metrics arrived is moved aside as `poisoned-global_step_N` and verl's tracker pointed back.")
    short_run: StopOrOff = Field(
        "stop", description="Fail the run when the engine exits 0 with fewer steps than it planned (a resume "
        "at an epoch boundary that ends training), or skips or repeats a step.")
    data_position: StopOrOff = Field(
        "stop", description="Before a resume, check that the checkpoint holds where the data stopped (verl: "
        "`data.pt`, its dataloader's state; local: `trainer_state.json` at that step); without it the "
        "resumed run would start the data over.")

    @field_validator("rollout_mismatch", "reward_collapse_steps", "non_finite", "short_run", "data_position",
                     mode="before")
    @classmethod
    def off_from_yaml(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML (and so `--set`) reads `off` as false: both mean `off`; `true` is `stop` where that is a choice."""
        threshold = info.field_name in THRESHOLDS
        if isinstance(value, bool):
            if not value:
                return "off"
            if threshold:
                raise ValueError(f"expects {THRESHOLDS[info.field_name]}, not true")
            return "stop"
        if threshold and value != "off":
            return _threshold(value, info.field_name)
        return value

    def on(self, name: str) -> bool:
        return getattr(self, name) != "off"


# A threshold guard's value in the user's words: pydantic's own error for the union named its parts
# (`constrained-float`, `literal['off']`) in two lines.
THRESHOLDS = {"rollout_mismatch": "a number greater than 0 (a KL per token) or off",
              "reward_collapse_steps": f"a whole number of steps from 1 to {MAX_SEQUENCES} or off"}


def _threshold(value: Any, name: str) -> float | int:
    try:
        number = float(value)
        if name == "reward_collapse_steps":
            if number != int(number):
                raise ValueError
            number = int(number)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expects {THRESHOLDS[name]}, not {value!r}") from None
    if not 0 < number <= (MAX_SEQUENCES if name == "reward_collapse_steps" else float("inf")):
        raise ValueError(f"expects {THRESHOLDS[name]}, not {value!r}")
    return number
