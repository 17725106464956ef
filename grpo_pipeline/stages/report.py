"""The run report: `runs/<run>/report.md` and its plots, readable on its own.

    python -m grpo_pipeline --model tiny --device cpu --run-name try1   # ends with the report's path

It puts together what the stages wrote: the evaluation (stages/benchmark_report.py: a table per benchmark,
base vs trained with deltas and 95% intervals, the curve over saved steps and the best one, their plots),
the reward curve over training steps (PNG, matplotlib), the guards' panel (stages/guard_panel.py), the device,
the environment (redacted), the settings that differ from the defaults, how long each stage took, and links to every file.
A failed run gets a report too, saying which stage failed and why.
"""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.backends.metrics import read_metrics
from grpo_pipeline.store.files import write_text_atomic
from grpo_pipeline.cluster.preflight import Preflight
from grpo_pipeline.planner.memory import MemoryPlan, memory_table
from grpo_pipeline.stages import guard_panel
from grpo_pipeline.rewards.builtin import BUILTIN_REWARD_RANGE
from grpo_pipeline.stages.benchmark_report import (benchmark_tables, benchmarks_of,
                                                   plot_benchmarks, plot_checkpoint_curve, pyplot)
from grpo_pipeline.run.folder import RunFolder


def plot_reward_curve(metrics_file: Path, out: Path, reward_range: tuple[float, float] | None = None) -> bool:
    """Mean reward by step with a band of one standard deviation, cut to the rewards' range where it is
    known (a reward of 0.1 +- 0.3 never went below 0)."""
    records = read_metrics(metrics_file)
    if not records:
        return False
    plt = pyplot()
    steps = [r.step for r in records]
    mean = [r.reward_mean for r in records]
    std = [r.reward_std or 0.0 for r in records]
    figure, axis = plt.subplots(figsize=(7, 3.5), dpi=100)
    axis.plot(steps, mean, marker="o", markersize=3, label="mean reward")
    low, high = reward_range or (float("-inf"), float("inf"))
    axis.fill_between(steps, [max(m - s, low) for m, s in zip(mean, std)], [min(m + s, high) for m, s in zip(mean, std)],
                      alpha=0.2, label="± std" + (f" (within {low:g}..{high:g})" if reward_range else ""))
    axis.set_xlabel("training step")
    axis.set_ylabel("reward")
    axis.set_title("Reward during training")
    axis.legend(loc="upper left")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True


# What a user's reward leaves of the accuracy columns (rewards/plan.py BatchScores): it says nothing of
# correctness, so those two count its sum against full marks.
USER_REWARD_METRICS = ("With the reward the run brings, *accuracy* is the share of responses that got full marks (the sum "
                       "of the positive weights) and *format* the share that got any reward above 0; the mean reward is "
                       "the reward's own measure (docs/rewards-and-data.md).")

STEP_ROWS = 20  # a longer run's table shows this many steps, evenly spaced, the last included


def step_table(records: list) -> list[str]:
    """The training steps as a table (every step up to STEP_ROWS, else evenly spaced ones and the last)."""
    shown = records if len(records) <= STEP_ROWS else [
        records[round(i * (len(records) - 1) / (STEP_ROWS - 1))] for i in range(STEP_ROWS)]
    lines = ["| step | reward (mean ± std) | response length | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.step} | {r.reward_mean:.3f}{'' if r.reward_std is None else f' ± {r.reward_std:.3f}'} | "
              f"{r.response_length:.1f} | {r.step_time_s:.1f} |" for r in shown]
    if len(shown) < len(records):
        lines.append(f"\n{len(shown)} of {len(records)} steps shown.")
    return lines


def time_table(timings: dict[str, float], records: list) -> list[str]:
    """How long each stage took; training split into its steps and the rest (Ray, the workers and the model
    starting, checkpoints); the flow's bookkeeping steps under 0.1 s as one row."""
    total = sum(timings.values())
    lines = ["## Time per stage", "", "| stage | seconds | share |", "|---|---|---|"]
    small = {stage: seconds for stage, seconds in timings.items() if seconds < 0.1}
    for stage, seconds in timings.items():
        if stage in small:
            continue
        lines.append(f"| {stage} | {seconds:.1f} | {seconds / total:.0%} |")
        if stage == "train" and records:
            steps = sum(r.step_time_s for r in records)
            lines += [f"| &nbsp;&nbsp;{len(records)} GRPO steps | {steps:.1f} | {steps / total:.0%} |",
                      f"| &nbsp;&nbsp;start-up (Ray, workers, model load) and checkpoints | {max(seconds - steps, 0):.1f} | "
                      f"{max(seconds - steps, 0) / total:.0%} |"]
    if small:
        lines.append(f"| {len(small)} other steps (planning, checks) | {sum(small.values()):.1f} | |")
    return [*lines, f"| **all** | {total:.1f} | |", ""]


def settings_text(profile: dict[str, Any]) -> str:
    """The settings of the run that differ from its recipe's and device's defaults, as YAML (the resolved
    profile holds ~200 lines, mostly defaults and the settings of the other backend)."""
    from grpo_pipeline.profiles.loader import builtin_models, resolve_run_profile

    model = profile["model"]["name"] if profile["model"]["name"] in builtin_models() else profile["model"]["path"]
    try:
        default, _ = resolve_run_profile(model, profile["platform"]["kind"], profile["backend"], None, [], validate=False)
    except Exception:  # a recipe that no longer resolves (an older run's report, rendered again): say so
        return "# the defaults could not be resolved again: see profile.yaml"
    changed = _difference(profile, default.model_dump(mode="json"))
    return yaml.safe_dump(changed, sort_keys=False).rstrip() if changed else "# none: the recipe's defaults as they are"


def _difference(value: Any, default: Any) -> Any:
    """What of `value` differs from `default`, keeping the nesting (None when nothing does)."""
    if isinstance(value, dict) and isinstance(default, dict):
        changed = {key: d for key, item in value.items() if (d := _difference(item, default.get(key))) is not None}
        return changed or None
    return None if value == default else value


def _tracker_link(name: str, where: str) -> str:
    """A tracker's place as a link a person can click where it starts with a URL; the rest stays as text."""
    url, _, note = where.partition(" ")
    if url.startswith(("http://", "https://")):
        return f"[{name}]({url})" + (f" {note}" if note else "")
    return f"{name}: {where}"


def _memory_plan(profile: dict[str, Any], device: dict[str, Any]) -> MemoryPlan | None:
    """The memory plan the run was checked against at planning, made again from its profile."""
    from grpo_pipeline.profiles.schema import RunProfile
    from grpo_pipeline.stages.device import DeviceInfo

    run_profile = RunProfile.model_validate(profile)
    found = DeviceInfo.model_validate(device) if device else DeviceInfo(kind=run_profile.platform.kind,
                                                                         decided_by="requested", reason="")
    return found.memory_plan(run_profile)


def _adapter_line(profile: dict[str, Any]) -> str | None:
    """A LoRA run's adapter as the dry run said it (rank, modules, trainable share); None for full fine-tuning."""
    from grpo_pipeline.planner.lora import describe_adapter
    from grpo_pipeline.profiles.schema import RunProfile

    return describe_adapter(RunProfile.model_validate(profile))


class _Files:
    """report.md: plots and files by their path relative to the run folder (the report sits in it)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def image(self, name: str, alt: str) -> str:
        return f"![{alt}]({name})"

    def file(self, path: str | Path, label: str | None = None) -> str:
        relative = Path(path).relative_to(self.run_dir).as_posix() if Path(path).is_absolute() else str(path)
        return f"[{label or relative}]({relative})"


class _Embedded(_Files):
    """The Prefect artifact: the UI resolves relative links against its own URL (they 404), so the plots
    are embedded as data URIs and files are named by their absolute path, as text."""

    def image(self, name: str, alt: str) -> str:
        data = base64.b64encode((self.run_dir / name).read_bytes()).decode()
        return f"![{alt}](data:image/png;base64,{data})"

    def file(self, path: str | Path, label: str | None = None) -> str:
        full = Path(path) if Path(path).is_absolute() else self.run_dir / path
        return f"{label + ': ' if label else ''}`{full}`"


def _preflight(run_dir: Path) -> Preflight | None:
    """The cluster preflight's answers, when the run asked its nodes (a damaged file is left out)."""
    try:
        return Preflight.model_validate_json((run_dir / RunFolder.NODES).read_text())
    except (OSError, ValueError):
        return None


def write_report(run_dir: Path, **parts: Any) -> Path:
    """Write report.md (and its plots) from what the run produced; every part may be missing (see `render`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    evaluation = parts.get("evaluation") or {}
    plot_benchmarks(evaluation, run_dir / RunFolder.EVAL_PLOT)
    plot_checkpoint_curve(evaluation, run_dir / RunFolder.CURVE_PLOT)
    if parts.get("train"):
        rewards = (parts.get("profile") or {}).get("reward") or {}
        custom = rewards.get("functions") or rewards.get("url")  # a reward users bring has a range of its own
        plot_reward_curve(Path(parts["train"]["metrics_file"]), run_dir / RunFolder.REWARD_CURVE,
                          None if custom else BUILTIN_REWARD_RANGE)
    guard_panel.draw(run_dir, read_metrics(run_dir / RunFolder.METRICS), parts.get("profile"))
    return write_text_atomic(run_dir / RunFolder.REPORT, render(run_dir, _Files(run_dir), **parts))


def ui_report(run_dir: Path, **parts: Any) -> str:
    """The same report for Prefect's UI (after `write_report` drew its plots): plots embedded, paths as text."""
    return render(run_dir, _Embedded(run_dir), **parts)


def render(
    run_dir: Path,
    media: _Files,
    *,
    profile: dict[str, Any] | None = None,
    device: dict[str, Any] | None = None,
    env: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    failure: str | None = None,
    stopped: list[str] | None = None,
    tracking: dict[str, str] | None = None,
) -> str:
    parts = [f"# GRPO run `{run_dir.name}`", "", f"Run folder `{run_dir}` on host `{socket.gethostname()}`.", ""]
    if failure:
        # A refusal names a line per node: each stays in the quote.
        parts += ["\n".join(f"> {line}" for line in f"**The run failed.** {failure}".splitlines()), ""]
        last = read_metrics(run_dir / RunFolder.METRICS)
        parts += [f"- last completed training step: {last[-1].step if last else 'none'}",
                  f"- stopped: {', '.join(stopped) if stopped else 'nothing was running'}", ""]
    if tracking:
        parts += ["Experiment tracking: " + "; ".join(_tracker_link(name, where) for name, where in tracking.items()) + ".", ""]
    if profile:
        model, data, algo = profile["model"], profile["data"], profile["algorithm"]
        parts += [f"Model **{model['name']}** (`{model['path']}`), dataset **{data['dataset']}**, backend "
                  f"**{profile['backend']}**, device **{profile['platform']['kind']}**; GRPO with {algo['rollout_n']} "
                  f"responses per prompt, {data['train_batch_size']} prompts per step, learning rate {algo['lr']}.", ""]
        if adapter := _adapter_line(profile):
            parts += [f"Trained as an adapter: {adapter}.", ""]
    models = (evaluation or {}).get("models") or []
    if models:
        engine = f" Generated with {evaluation['engine']}." if evaluation.get("engine") else ""
        names, n = benchmarks_of(evaluation), models[0].get("n", models[0]["k"])
        what = (f"{models[0]['prompts']} validation prompts, {n} response(s) each, scored with the training reward"
                if names == ["heldout"] else f"{n} response(s) to each prompt of {', '.join(names)}, each benchmark "
                "scored with its built-in reward (`heldout`, the validation split: with the training reward)")
        parts += ["## Evaluation", "", f"{what}; 95% intervals over prompts (bootstrap), pass@k by the unbiased "
                  f"estimator.{engine}", "", benchmark_tables(evaluation), ""]
        brought = (profile or {}).get("reward") or {}
        if brought.get("functions") or brought.get("url"):
            parts += [USER_REWARD_METRICS, ""]
        parts += [f"Generation time: {evaluation['generation']}.", ""] if evaluation.get("generation") else []
        for plot, alt in ((RunFolder.EVAL_PLOT, "evaluation"), (RunFolder.CURVE_PLOT, "checkpoints")):
            if (run_dir / plot).is_file():
                parts += [media.image(plot, alt), ""]
        parts += ["Per-sample results: " + ", ".join(
            media.file(m["samples_file"], m["name"] if m.get("benchmark", "heldout") == "heldout"
                       else f"{m['benchmark']}/{m['name']}") for m in models), ""]
    if train:
        parts += ["## Training", ""]
        if train.get("already_complete"):
            parts += [f"Already complete at step {train['steps_done']}: nothing was trained by this run.", ""]
        else:
            resumed = f", resumed from step {train['resumed_from']}" if train.get("resumed_from") is not None else ""
            parts += [f"{train['steps_done']} of {train['max_steps']} steps{resumed}; policy in "
                      f"{media.file(train['checkpoint_dir'])}.", ""]
        if train.get("rollouts"):
            parts += [f"Rollouts: {train['rollouts']}.", ""]
        if (run_dir / RunFolder.REWARD_CURVE).is_file():
            parts += [media.image(RunFolder.REWARD_CURVE, "reward curve"), ""]
        if records := read_metrics(Path(train["metrics_file"])):
            parts += [*step_table(records), "", f"Every step's record: {media.file(train['metrics_file'])}", ""]
    parts += guard_panel.section(run_dir, media.image, profile)
    if profile and (memory := _memory_plan(profile, device or {})):
        parts += ["## Memory plan", "", "Estimated device memory per role of the layout (planner/):", ""]
        parts += memory_table(memory.summary()) + [""]
    if checked := _preflight(run_dir):
        parts += ["## Nodes", "", f"What each node's image has, asked before the job was submitted ({checked.summary_line()}):",
                  "", *checked.table(), ""]
    if timings:
        parts += time_table(timings, read_metrics(Path(train["metrics_file"])) if train else [])
    if device:
        parts += ["## Device", "", f"{device['kind']}, {device.get('count', 0)} device(s), decided by "
                  f"{device.get('decided_by', '?')}: {device.get('reason', '')}", ""]
    if env:
        parts += ["## Environment (secrets redacted)", "", "| variable | value | source |", "|---|---|---|"]
        parts += [f"| `{name}` | `{item['value']}` | {item['source']} |" for name, item in env.items()]
        parts.append("")
    if profile:
        parts += ["## Settings", "", f"The run's settings that differ from the defaults of its recipe and device; every "
                  f"setting: {media.file(RunFolder.PROFILE)}.", "", "```yaml", settings_text(profile), "```", ""]
    # Dot files are the run's bookkeeping (its lock), not results.
    files = sorted(p.name for p in run_dir.iterdir() if p.is_file() and p.name != RunFolder.REPORT and not p.name.startswith("."))
    parts += ["## Files", ""] + [f"- {media.file(name)}" for name in files] + [""]
    return "\n".join(parts)
