"""The evaluation's part of the report: a table per benchmark (models side by side, with 95% intervals),
the held-out curve over saved steps with the best one marked, and their plots.

    python -m grpo_pipeline --model tiny --device cpu --set 'eval.benchmarks=[heldout,arith]' --set eval.checkpoints=all

Everything here reads the evaluation's JSON (`runs/<run>/eval/eval.json`, stages/evaluate.py `EvalReport`),
so a report can be drawn again from a finished run's folder; the Prefect artifact `evaluation` is
`benchmark_tables`.
"""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.stages.eval_metrics import metric_value

_HELDOUT = "heldout"


def benchmarks_of(evaluation: dict) -> list[str]:
    """The benchmarks in the order they were asked for (an evaluation older than benchmarks: `heldout`)."""
    return list(dict.fromkeys(m.get("benchmark", _HELDOUT) for m in evaluation.get("models") or []))


def results_on(evaluation: dict, benchmark: str) -> list[dict]:
    return [m for m in evaluation.get("models") or [] if m.get("benchmark", _HELDOUT) == benchmark]


def side_by_side(evaluation: dict, benchmark: str) -> list[dict]:
    """The models a table compares: every fixed model (base, eval.models), then of the saved steps the best
    and the last; every model when no steps were evaluated."""
    results = results_on(evaluation, benchmark)
    steps = [m for m in results if m.get("step") is not None]
    if not steps:
        return results
    best = (evaluation.get("best") or {}).get("step")
    shown = {best, max(m["step"] for m in steps)}
    return [m for m in results if m.get("step") is None or m["step"] in shown]


def _label(model: dict, evaluation: dict) -> str:
    marks = []
    if model.get("step") is not None:
        if model["step"] == (evaluation.get("best") or {}).get("step"):
            marks.append("best")
        if model["step"] == max(m["step"] for m in evaluation["models"] if m.get("step") is not None):
            marks.append("last")
    return model["name"] + (f" ({', '.join(marks)})" if marks else "")


def _with_interval(value: float, interval) -> str:
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else f"{value:.3f}"


def _rows(model: dict) -> list[tuple[str, float, str]]:
    """(label, value, cell) of each metric of a model's result, in the table's order."""
    ci = model.get("ci95") or {}
    rows = [("mean reward", model["mean_reward"], _with_interval(model["mean_reward"], model.get("reward_ci95")))]
    if model.get("pass_at"):
        n = model.get("n", model["k"])
        rows.append((f"avg@{n}", model["avg_at_n"], _with_interval(model["avg_at_n"], ci.get("avg@n"))))
        rows += [(name, value, _with_interval(value, ci.get(name))) for name, value in model["pass_at"].items()]
    else:  # an evaluation from before pass@k had intervals
        rows += [("accuracy", model["accuracy"], f"{model['accuracy']:.3f}"),
                 ("pass@k", model["pass_at_k"], f"{model['pass_at_k']:.3f}")]
    rows += [("format rate", model["format_rate"], f"{model['format_rate']:.3f}"),
             ("response length", model["response_length_mean"], f"{model['response_length_mean']:.3f}"),
             ("truncated", model["truncation_rate"], f"{model['truncation_rate']:.3f}")]
    return rows


def metrics_table(models: list[dict], evaluation: dict | None = None) -> str:
    """Models side by side, with the last minus the first (95% intervals in brackets)."""
    evaluation = evaluation or {"models": models}
    header = "| metric | " + " | ".join(_label(m, evaluation) for m in models) + \
        (f" | {models[-1]['name']} - {models[0]['name']} |" if len(models) > 1 else " |")  # the last minus the first
    lines = [header, "|---" * (len(models) + 1 + (len(models) > 1)) + "|"]
    table = [_rows(m) for m in models]
    for index, (label, _, _) in enumerate(table[0]):
        cells = [rows[index][2] for rows in table]
        delta = f" {table[-1][index][1] - table[0][index][1]:+.3f} |" if len(models) > 1 else ""
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + delta)
    return "\n".join(lines)


def curve_table(evaluation: dict) -> str:
    """The held-out curve: every evaluated step's selection metric on each benchmark, the best one marked."""
    best = evaluation.get("best") or {}
    metric = best.get("metric", "pass@1")
    steps = sorted({m["step"] for m in evaluation["models"] if m.get("step") is not None})
    names = benchmarks_of(evaluation)
    lines = ["| step | " + " | ".join(f"{name} {metric}" for name in names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in steps:
        cells = []
        for name in names:
            found = [m for m in results_on(evaluation, name) if m.get("step") == step]
            cells.append(_metric_cell(found[0], metric) if found else "")
        mark = " **best**" if step == best.get("step") else ""
        lines.append(f"| {step}{mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _metric_cell(model: dict, metric: str) -> str:
    return _with_interval(*metric_value(model, metric))


def benchmark_tables(evaluation: dict) -> str:
    """Each benchmark's table, the curve over steps and the best step, in Markdown (report and UI artifact)."""
    parts = []
    several = benchmarks_of(evaluation) != [_HELDOUT]
    for name in benchmarks_of(evaluation):
        models = side_by_side(evaluation, name)
        if several:
            file = (evaluation.get("benchmarks") or {}).get(name, "")
            parts += [f"### {name}", "", f"{models[0]['prompts']} prompts, {models[0].get('n', models[0]['k'])} "
                      f"response(s) each{f' (`{file}`)' if file else ''}.", ""]
        parts += [metrics_table(models, evaluation), "", verdict(models), ""]
    if best := evaluation.get("best"):
        parts += ["### Checkpoints", "", f"Every saved step evaluated (eval.checkpoints={evaluation.get('checkpoints')}); "
                  f"the best by {best['benchmark']} {best['metric']} is **{best['name']}** "
                  f"({_with_interval(best['value'], best['ci95'])}), exported as the run's `best` (`{best['path']}`).", "",
                  curve_table(evaluation), ""]
    return "\n".join(parts).rstrip()


def verdict(models: list[dict]) -> str:
    if len(models) < 2:
        return ""
    first, last = models[0], models[-1]
    if last["reward_ci95"][0] > first["reward_ci95"][1]:
        return f"**{last['name']}** beats **{first['name']}**: the 95% intervals of the mean reward do not overlap."
    if last["reward_ci95"][1] < first["reward_ci95"][0]:
        return f"**{last['name']}** is worse than **{first['name']}**: the 95% intervals of the mean reward do not overlap."
    return (f"The 95% intervals of the mean reward overlap: the difference between **{first['name']}** and "
            f"**{last['name']}** may be noise.")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
    import matplotlib.pyplot as plt

    return plt


def plot_benchmarks(evaluation: dict, out: Path) -> bool:
    """One panel per benchmark: each compared model's metrics as bars with their 95% intervals."""
    names = benchmarks_of(evaluation)
    if not names:
        return False
    plt = pyplot()
    figure, axes = plt.subplots(1, len(names), figsize=(max(7, 4.5 * len(names)), 3.8), dpi=100, squeeze=False)
    for axis, name in zip(axes[0], names):
        models = side_by_side(evaluation, name)
        metrics = [label for label, _, _ in _rows(models[0]) if label not in ("response length", "truncated")]
        width = 0.8 / len(models)
        for index, model in enumerate(models):
            xs = [i + index * width for i in range(len(metrics))]
            plotted = [_plotted(model, label) for label in metrics]
            axis.bar(xs, [value for value, _ in plotted], width, label=_label(model, evaluation))
            # Error bars only where a metric has an interval (the format rate has none): no zero-height bars.
            for x, (value, interval) in zip(xs, plotted):
                if interval is not None:
                    axis.errorbar(x, value, yerr=[[value - interval[0]], [interval[1] - value]], fmt="none",
                                  ecolor="black", capsize=3)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(metrics))], metrics, rotation=20)
        axis.set_ylim(0, 1.05)
        axis.set_title(name if name != _HELDOUT else "held-out split")
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("Evaluation (bars: 95% intervals over prompts)")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True


def _plotted(model: dict, label: str) -> tuple[float, tuple[float, float] | None]:
    """A metric's value and its 95% interval (None: the metric has none)."""
    if label == "mean reward" or label.startswith("avg@") or label in (model.get("pass_at") or {}):
        return metric_value(model, "mean_reward" if label == "mean reward" else "avg@n" if label.startswith("avg@") else label)
    key = {"accuracy": "accuracy", "pass@k": "pass_at_k", "format rate": "format_rate"}[label]
    return model[key], None


def plot_checkpoint_curve(evaluation: dict, out: Path) -> bool:
    """The chosen metric of every evaluated step, per benchmark, with its interval; the best step marked."""
    best = evaluation.get("best")
    if not best:
        return False
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.8), dpi=100)
    for name in benchmarks_of(evaluation):
        points = sorted((m["step"], *metric_value(m, best["metric"])) for m in results_on(evaluation, name)
                        if m.get("step") is not None)
        if not points:
            continue
        steps = [p[0] for p in points]
        axis.plot(steps, [p[1] for p in points], marker="o", markersize=3, label=name)
        axis.fill_between(steps, [p[2][0] for p in points], [p[2][1] for p in points], alpha=0.15)
    axis.axvline(best["step"], color="grey", linestyle="--", label=f"best: {best['name']}")
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 on the axis
    axis.set_xlabel("training step")
    axis.set_ylabel(best["metric"])
    axis.set_title(f"{best['metric']} of each saved checkpoint (bands: 95% intervals)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True
