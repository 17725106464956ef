"""The run report: `runs/<run>/report.md` and its plots, readable on its own.

    python -m grpo_pipeline --model tiny --device cpu --run-name try1   # ends with the report's path

It puts together what the stages wrote: the base vs trained table (deltas, bootstrap intervals),
the reward curve over training steps and the evaluation comparison (PNG, matplotlib), the guards'
panel (stages/guard_panel.py), the device,
the environment (redacted), the resolved profile, how long each stage took, and links to every file.
A failed run gets a report too, saying which stage failed and why.
"""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.backends.metrics import METRICS, read_metrics
from grpo_pipeline.common.files import write_text_atomic
from grpo_pipeline.common.rewards import BUILTIN_REWARD_RANGE
from grpo_pipeline.common.preflight import PREFLIGHT_FILE, Preflight
from grpo_pipeline.planner.memory import MemoryPlan, memory_table
from grpo_pipeline.stages import guard_panel

REPORT = "report.md"
REWARD_CURVE = "reward_curve.png"
EVAL_PLOT = "eval_comparison.png"
TABLE_METRICS = (
    ("mean_reward", "mean reward"),
    ("accuracy", "accuracy"),
    ("format_rate", "format rate"),
    ("pass_at_k", "pass@k"),
    ("response_length_mean", "response length"),
    ("truncation_rate", "truncated"),
)


def plot_reward_curve(metrics_file: Path, out: Path, reward_range: tuple[float, float] | None = None) -> bool:
    """Mean reward by step with a band of one standard deviation, cut to the rewards' range where it is
    known (a reward of 0.1 +- 0.3 never went below 0)."""
    records = read_metrics(metrics_file)
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
    import matplotlib.pyplot as plt

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


def plot_eval(models: list[dict], out: Path) -> bool:
    if not models:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("mean_reward", "accuracy", "format_rate")
    figure, axis = plt.subplots(figsize=(7, 3.5), dpi=100)
    width = 0.8 / len(models)
    for index, model in enumerate(models):
        xs = [i + index * width for i in range(len(names))]
        values = [model[n] for n in names]
        low, high = model["reward_ci95"]
        axis.bar(xs, values, width, label=model["name"])
        # The interval is the mean reward's (bootstrap); the other bars have none, so no zero-height bar.
        axis.errorbar(xs[0], model["mean_reward"], yerr=[[model["mean_reward"] - low], [high - model["mean_reward"]]],
                      fmt="none", ecolor="black", capsize=4)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], ["mean reward (95% CI)", "accuracy", "format rate"])
    axis.set_ylim(0, 1.05)
    axis.set_title("Evaluation on the validation split")
    axis.legend()
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True


def metrics_table(models: list[dict]) -> str:
    """Models side by side, with the last minus the first: the report's table and the Prefect
    artifact `evaluation`."""
    header = "| metric | " + " | ".join(m["name"] for m in models) + (" | Δ (last - first) |" if len(models) > 1 else " |")
    lines = [header, "|---" * (len(models) + 1 + (len(models) > 1)) + "|"]
    for key, label in TABLE_METRICS:
        cells = []
        for m in models:
            cell = f"{m[key]:.3f}" if isinstance(m[key], float) else str(m[key])
            if key == "mean_reward":
                cell += f" [{m['reward_ci95'][0]:.3f}, {m['reward_ci95'][1]:.3f}]"
            cells.append(cell)
        delta = f" {models[-1][key] - models[0][key]:+.3f} |" if len(models) > 1 else ""
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + delta)
    return "\n".join(lines)


def _verdict(models: list[dict]) -> str:
    if len(models) < 2:
        return ""
    first, last = models[0], models[-1]
    if last["reward_ci95"][0] > first["reward_ci95"][1]:
        return f"**{last['name']}** beats **{first['name']}**: the 95% intervals of the mean reward do not overlap."
    if last["reward_ci95"][1] < first["reward_ci95"][0]:
        return f"**{last['name']}** is worse than **{first['name']}**: the 95% intervals of the mean reward do not overlap."
    return (f"The 95% intervals of the mean reward overlap: the difference between **{first['name']}** and "
            f"**{last['name']}** may be noise.")


STEP_ROWS = 20  # a longer run's table shows this many steps, evenly spaced, the last included


def step_table(records: list) -> list[str]:
    """The training steps as a table (every step up to STEP_ROWS, else evenly spaced ones and the last)."""
    shown = records if len(records) <= STEP_ROWS else [
        records[round(i * (len(records) - 1) / (STEP_ROWS - 1))] for i in range(STEP_ROWS)]
    lines = ["| step | reward (mean ± std) | response length | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.step} | {r.reward_mean:.3f} ± {r.reward_std or 0.0:.3f} | {r.response_length:.1f} | {r.step_time_s:.1f} |"
              for r in shown]
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
        return Preflight.model_validate_json((run_dir / PREFLIGHT_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_report(run_dir: Path, **parts: Any) -> Path:
    """Write report.md (and its plots) from what the run produced; every part may be missing (see `render`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    models = (parts.get("evaluation") or {}).get("models") or []
    plot_eval(models, run_dir / EVAL_PLOT)
    if parts.get("train"):
        custom = ((parts.get("profile") or {}).get("algorithm") or {}).get("reward_function")
        plot_reward_curve(Path(parts["train"]["metrics_file"]), run_dir / REWARD_CURVE,
                          None if custom else BUILTIN_REWARD_RANGE)
    guard_panel.draw(run_dir, read_metrics(run_dir / METRICS), parts.get("profile"))
    return write_text_atomic(run_dir / REPORT, render(run_dir, _Files(run_dir), **parts))


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
        last = read_metrics(run_dir / METRICS)
        parts += [f"- last completed training step: {last[-1].step if last else 'none'}",
                  f"- stopped: {', '.join(stopped) if stopped else 'nothing was running'}", ""]
    if tracking:
        parts += ["Experiment tracking: " + "; ".join(_tracker_link(name, where) for name, where in tracking.items()) + ".", ""]
    if profile:
        model, data, algo = profile["model"], profile["data"], profile["algorithm"]
        parts += [f"Model **{model['name']}** (`{model['path']}`), dataset **{data['dataset']}**, backend "
                  f"**{profile['backend']}**, device **{profile['platform']['kind']}**; GRPO with {algo['rollout_n']} "
                  f"responses per prompt, {data['train_batch_size']} prompts per step, learning rate {algo['lr']}.", ""]
    models = (evaluation or {}).get("models") or []
    if models:
        engine = f" Generated with {evaluation['engine']}." if evaluation.get("engine") else ""
        parts += ["## Evaluation", "", f"{models[0]['prompts']} validation prompts, {models[0]['k']} response(s) each, "
                  f"scored with the training reward.{engine}", "", metrics_table(models), "", _verdict(models), ""]
        parts += [f"Generation time: {evaluation['generation']}.", ""] if evaluation.get("generation") else []
        if (run_dir / EVAL_PLOT).is_file():
            parts += [media.image(EVAL_PLOT, "evaluation"), ""]
        parts += ["Per-sample results: " + ", ".join(media.file(m["samples_file"], m["name"]) for m in models), ""]
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
        if (run_dir / REWARD_CURVE).is_file():
            parts += [media.image(REWARD_CURVE, "reward curve"), ""]
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
                  f"setting: {media.file('profile.yaml')}.", "", "```yaml", settings_text(profile), "```", ""]
    # Dot files are the run's bookkeeping (its lock), not results.
    files = sorted(p.name for p in run_dir.iterdir() if p.is_file() and p.name != REPORT and not p.name.startswith("."))
    parts += ["## Files", ""] + [f"- {media.file(name)}" for name in files] + [""]
    return "\n".join(parts)
