"""The report's guards panel: what the guards read, step by step, so a person sees a run drift before a
guard stops it, and which guard stopped it.

    python -m grpo_pipeline --model tiny --device cpu    # report.md: "## Guards", guards.png

Three small plots from metrics.jsonl (backends/metrics.py): the rollout vs trainer mismatch with its
threshold, the share of groups with zero advantage, and the gradient norm; the guards' settings; and,
when one tripped, its line and what was kept (`runs/<run>/guards.json`, written by the train stage).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from grpo_pipeline.backends.guards import GuardTrip
from grpo_pipeline.backends.metrics import StepMetrics, read_metrics
from grpo_pipeline.run.folder import RunFolder

PANELS = (("mismatch", "rollout vs trainer mismatch\n(KL per token)"), ("zero_advantage_share", "zero-advantage groups"),
          ("grad_norm", "gradient norm"))


def plot_guards(records: list[StepMetrics], mismatch_threshold: float | None, out: Path) -> bool:
    """The panel as a PNG; False when no step measured any of its values."""
    if not any(getattr(r, name) is not None for r in records for name, _ in PANELS):
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(PANELS), figsize=(10, 2.6), dpi=100)
    for axis, (name, title) in zip(axes, PANELS):
        points = [(r.step, getattr(r, name)) for r in records if getattr(r, name) is not None]
        finite = [(step, value) for step, value in points if math.isfinite(value)]
        if finite:
            axis.plot(*zip(*finite), marker="o", markersize=3)
        for step in (step for step, value in points if not math.isfinite(value)):
            axis.axvline(step, color="red", alpha=0.6)  # a non-finite value: where the line would break
        if name == "mismatch":
            if mismatch_threshold is not None:
                axis.axhline(mismatch_threshold, color="red", linestyle="--", linewidth=1, label="threshold")
                axis.legend(loc="upper left", fontsize=7)
            if any(value > 0 for _, value in finite):
                axis.set_yscale("log")
        if name == "zero_advantage_share":
            axis.set_ylim(-0.05, 1.05)
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("training step", fontsize=8)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True


def read_trip(run_dir: Path) -> GuardTrip | None:
    try:
        return GuardTrip.model_validate_json((Path(run_dir) / RunFolder.GUARDS).read_text())
    except (OSError, ValueError):
        return None


def draw(run_dir: Path, records: list[StepMetrics], profile: dict[str, Any] | None) -> None:
    """guards.png beside the report (nothing when no step measured a guard's value)."""
    threshold = ((profile or {}).get("guards") or {}).get("rollout_mismatch")
    plot_guards(records, threshold if isinstance(threshold, (int, float)) else None, Path(run_dir) / RunFolder.GUARDS_PLOT)


def section(run_dir: Path, image, profile: dict[str, Any] | None) -> list[str]:
    """The report's `## Guards` lines (`image(name, alt)` places the plot); none before training wrote a step."""
    records, trip = read_metrics(Path(run_dir) / RunFolder.METRICS), read_trip(run_dir)
    if not records and trip is None:
        return []
    parts = ["## Guards", ""]
    if trip is not None:
        parts += [f"**Stopped by the `{trip.guard}` guard**: {trip.line}." + (f" Kept: {trip.kept}." if trip.kept else ""),
                  ""]
    if settings := (profile or {}).get("guards"):
        parts += ["Settings: " + ", ".join(f"`{name}` {value}" for name, value in settings.items()) + ".", ""]
    if records:
        last = records[-1]
        shown = ", ".join(f"{label.splitlines()[0]} {_number(getattr(last, name))}" for name, label in PANELS)
        parts += [f"At step {last.step}: {shown}.", ""]
    if (Path(run_dir) / RunFolder.GUARDS_PLOT).is_file():
        parts += [image(RunFolder.GUARDS_PLOT, "guards"), ""]
    return parts


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
