"""One record per training step, whatever the engine: written to `runs/<run>/metrics.jsonl` by the
training side, followed by the flow (log, progress bar, Prefect artifact) and plotted by the report.

    python -m grpo_pipeline --model tiny --device cpu    # then: runs/<run>/metrics.jsonl
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_pipeline.store.files import write_text_atomic


class StepMetrics(BaseModel):
    # A NaN or an infinity is written as such (JSON's NaN, Infinity): written as null it would read back
    # as "not measured", or drop the record, and a poisoned step would vanish from the run's records.
    model_config = ConfigDict(ser_json_inf_nan="constants")

    step: int = Field(..., description="Optimizer step, from 1.")
    reward_mean: float
    reward_std: float | None = None
    kl: float | None = Field(None, description="KL to the reference policy (none without a KL loss).")
    loss: float | None = None
    entropy: float | None = None
    response_length: float = Field(0.0, description="Mean generated tokens per response.")
    tokens_per_s: float | None = Field(None, description="Generated tokens per second of step time.")
    step_time_s: float
    generation_s: float | None = Field(
        None, description="Seconds of the step spent generating rollouts (0 on the steps that reuse a round's).")
    learning_rate: float | None = None
    grad_norm: float | None = Field(None, description="Gradient norm of the update (before clipping).")
    mismatch: float | None = Field(
        None, description="Rollout vs trainer log-probs of the same tokens under the same weights: KL per token "
        "(k3 estimator) on the round's probe sequences (backends/guards.py).")
    zero_advantage_share: float | None = Field(
        None, description="Share of the step's groups whose rewards are all equal (their advantage is zero).")
    resumed_from: int | None = Field(None, description="Step the attempt that wrote this record resumed from.")
    rewards: dict[str, float] = Field(
        default_factory=dict, description="Each reward part's mean (`rewards/<name>/mean`) and a verl reward's numeric "
        "extras (`reward_extras/<key>/mean`), when the run's reward has parts or extras (rewards/plan.py).")
    time: float = Field(..., description="Unix time the step ended.")

    def log_line(self, max_steps: int) -> str:
        kl = "-" if self.kl is None else f"{self.kl:.4f}"
        # verl logs no spread of the step's rewards (critic/score/max and /min only): none is shown, never 0.
        spread = "" if self.reward_std is None else f" +- {self.reward_std:.3f}"
        return (f"step {self.step}/{max_steps} reward {self.reward_mean:.3f}{spread} | kl {kl} | "
                f"loss {self.loss or 0.0:.4f} | entropy {self.entropy or 0.0:.3f} | length {self.response_length:.1f} | "
                f"{self.tokens_per_s or 0.0:.0f} tokens/s | {self.step_time_s:.2f} s")


def append_metrics(path: Path, record: StepMetrics) -> None:
    with open(path, "a") as handle:
        handle.write(record.model_dump_json() + "\n")


def read_metrics(path: Path) -> list[StepMetrics]:
    """Every complete record of the file (a line being written is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(StepMetrics.model_validate_json(line))
        except ValidationError:
            continue
    return records


def keep_metrics_up_to(path: Path, step: int) -> None:
    """Steps after the checkpoint an attempt starts from are trained again: drop their old records."""
    if Path(path).is_file():
        kept = [record for record in read_metrics(path) if record.step <= step]
        write_text_atomic(path, "".join(record.model_dump_json() + "\n" for record in kept))


class MetricsFollower:
    """The records appended since the last call, in the order written: a step written twice comes twice,
    for the guards to see (backends/guards.py). The records there at the start (up to the step the
    attempt resumed from) are the earlier attempts'."""

    def __init__(self, path: Path):
        self.path, self.seen = path, len(read_metrics(path))

    def new(self) -> list[StepMetrics]:
        records = read_metrics(self.path)[self.seen:]
        self.seen += len(records)
        return records


def step_ranges(steps: list[int]) -> str:
    """1, 2, 3, 7 as `1-3, 7`."""
    spans: list[list[int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
