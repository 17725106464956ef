"""Command line of the GRPO pipeline.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run          # profile + command
    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run --json   # one JSON object
    python -m grpo_pipeline --model tiny --device cpu                                 # a Prefect flow run

Bad input (unknown model or device, unknown or mistyped setting, impossible parallel layout, a
profile file that is not YAML) prints one line naming the problem and its fix, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import yaml
from pydantic import ValidationError

from grpo_pipeline.flows.local_api import LocalAPIError, flush_prefect, local_api_unless_configured
from grpo_pipeline.run.request import RERUN_COMMAND, STAGES, RunRequest
from grpo_pipeline.errors import EXIT_USER_ERROR, UserError
from grpo_pipeline.profiles.backend_table import BackendChoice, backend_help, layout_planner
from grpo_pipeline.profiles.loader import builtin_models
from grpo_pipeline.planner.memory import memory_table
from grpo_pipeline.profiles.secrets import scrub
from grpo_pipeline.run.folder import RunFolder

if TYPE_CHECKING:
    from grpo_pipeline.stages.plan import RunPlan


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block first
        self.exit(EXIT_USER_ERROR, f"error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            # `--set key value`: the value is left over. Its key is named, never the value (it may be a secret).
            if split := [item for item in getattr(parsed, "overrides", []) if "=" not in item]:
                self.error(f"--set {split[0]} has no value; write it as one word: --set {split[0]}=VALUE")
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=f"{this_python()} -m grpo_pipeline",
        description="Run GRPO post-training as a Prefect flow, or print what a run would do (--dry-run).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"examples:\n  {this_python()} -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run\n"
        f"  {this_python()} -m grpo_pipeline --model tiny --device cpu --set trainer.total_training_steps=4",
    )
    parser.add_argument(
        "--model", default="smollm2-135m",
        help=f"built-in recipe ({', '.join(builtin_models())}) or a local HF model directory "
        "(default: smollm2-135m)",
    )
    parser.add_argument(
        "--device", default="auto",
        help="auto | gpu | npu | cpu (default: auto, or the DEVICE env var): where to train; auto probes "
        "NPU, then CUDA, then uses the CPU",
    )
    parser.add_argument(
        "--backend", default="auto",
        help=f"{' | '.join(get_args(BackendChoice))} (default: auto): {backend_help()}",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one profile setting, e.g. --set engine.tp=4 --set algorithm.use_kl_loss=true "
        "(repeatable; values are read as YAML)",
    )
    parser.add_argument("--profile-file", help="YAML file of profile settings, applied before --set")
    parser.add_argument(
        "--stages", help=f"comma-separated subset of the stages, in flow order ({','.join(STAGES)}); default: all"
    )
    parser.add_argument("--run-dir", default="runs", help="directory that holds one folder per run (default: runs)")
    parser.add_argument("--run-name", help="name of this run's folder (default: model-device-timestamp)")
    parser.add_argument("--ray-address", help="address of an existing Ray cluster (default: RAY_ADDRESS, or a local Ray)")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="resolve and validate everything, print the profile (YAML) and the exact training command, run "
        "nothing; a named --device is planned for without being required on this host",
    )
    parser.add_argument(
        "--suggest-layout", action="store_true",
        help=f"list the parallel layouts (TP, PP, CP, EP, ETP, rollout TP, offload, micro batch) of the "
        f"{layout_planner().name} backend "
        "that pass validation and fit in memory on cluster.nnodes x cluster.devices_per_node devices of --device, "
        "cheapest first by a simple cost model; runs nothing",
    )
    parser.add_argument(
        "--preflight", action="store_true",
        help="ask every node of the Ray cluster (--ray-address) whether its image has what the run's stages need "
        "there (the dry run's node requirements); submits and starts nothing; exit 2 when a node cannot run one",
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run or --suggest-layout: print one JSON object instead")
    return parser


def this_python() -> str:
    """The interpreter running this, as a person would type it here (`.venv/bin/python` in the checkout)."""
    try:
        return str(Path(sys.executable).relative_to(Path.cwd()))
    except ValueError:
        return sys.executable


def request_from_args(args: argparse.Namespace) -> RunRequest:
    fields = {
        "model": args.model,
        "device": args.device,
        "backend": args.backend,
        "overrides": args.overrides,
        "profile_file": args.profile_file,
        "run_name": args.run_name,
        "run_root": args.run_dir,
        "ray_address": args.ray_address,
    }
    if args.stages is not None:
        fields["stages"] = [s.strip() for s in args.stages.split(",") if s.strip()]
        if not fields["stages"]:
            raise UserError(f"--stages={args.stages!r} names no stage; list some ({','.join(STAGES)}) or leave the option "
                            "out to run them all")
    try:
        return RunRequest(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if field.startswith(("overrides", "ray_address", "model", "profile_file", "run_root", "run_name")):
            # Values that may carry a secret are never echoed; these messages name their option.
            raise UserError(message) from None
        raise UserError(f"--{field.replace('_', '-')}={getattr(args, field, None) or fields.get(field)!r}: {message}") from None


def print_dry_run(plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.summary(), indent=2))
        return
    from grpo_pipeline.backends import backend_for

    summary = plan.summary()
    print(f"# device: {plan.device.kind} ({plan.device.decided_by}: {plan.device.reason})")
    print(f"# backend: {plan.profile.backend} ({plan.backend_reason})")
    backend = backend_for(plan.profile.backend)
    print(f"# generation: {backend.generation_summary(plan.profile, plan.generation)}")
    for note in backend.algorithm_notes(plan.profile, plan.generation):
        print(f"# algorithm: {note}")
    print("# resolved profile")
    print(yaml.safe_dump(summary["profile"], sort_keys=False).rstrip())
    print("# environment of every process (secrets redacted; source: profile default or user export)")
    for name, item in summary["env"].items():
        print(f"#   {name}={item['value']}  [{item['source']}]")
    for reference in plan.env.unset_references:
        print(f"#   {reference}: not set here; a run refuses to start without it")
    if "lora" in summary:
        print(f"# lora: {summary['lora']}")
    if plan.memory and "note" in plan.memory:
        print(f"# memory plan: {plan.memory['note']}")
    elif plan.memory:
        print("# memory plan (planner/)")
        for line in memory_table(plan.memory):
            print(f"#   {line}")
    for stage, needs in plan.node_requirements.items():
        print(f"# node requirements of the {stage} stage (checked on every Ray node before it starts there)")
        for name, need in needs.items():
            print(f"#   {need.describe(name)}")
    label, command = command_lines(plan.command)
    print(f"# {label}")
    print(command)
    if job := plan.submission:
        print(f"# submitted by the train stage as Ray job {job['submission_id']} (<token>: fixed per run folder; "
              "the last part: the attempt)")
        print(f"#   metadata: {json.dumps(job['metadata'])}")
        print(f"#   runtime_env (every process of the job, on every node): {json.dumps(job['runtime_env'])}")


def print_run_summary(result: dict) -> None:
    """What a finished flow run produced, for a person; the same facts are in the run directory."""
    print(f"run directory: {result['run_dir']}  (device {result['device']})")
    if data := result.get("dataset"):
        state = "cached" if data["cached"] else "fetched and verified"
        print(f"dataset {data['dataset']} ({state}): {data['rows']['train']} train / {data['rows']['test']} test rows in {data['path']}")
    if model := result.get("model"):
        state = "cached" if model["cached"] else "prepared and verified"
        print(f"base model {model['source']} ({state}): {model['num_parameters']:,} parameters in {model['path']}")
    if (command := result.get("command")) and "train" in result:
        label, shown = command_lines(command)
        print(f"{label}:\n{shown}")
    if train := result.get("train"):
        if train["already_complete"]:
            print(f"training: already complete at step {train['steps_done']}; nothing trained")
        else:
            resumed = f", resumed from step {train['resumed_from']}" if train["resumed_from"] is not None else ""
            print(f"training: {train['steps_done']}/{train['max_steps']} steps{resumed}; policy in {train['checkpoint_dir']}")
        print(f"metrics: {train['metrics_file']}")
    if evaluation := result.get("eval"):
        from grpo_pipeline.stages.evaluate import EvalReport

        report = EvalReport.model_validate(evaluation)
        for metrics in report.models:
            print(f"eval {metrics.summary_line()}")
        if report.best is not None:
            print(report.best.line())
    if report := result.get("report"):
        print(f"report: {report}")


def command_lines(command: list[str]) -> tuple[str, str]:
    """(what the command is, the command to paste): the engine's own training command (verl's), or, for a
    backend that trains inside the flow, this run again from the command line, with this interpreter."""
    if command[:3] == RERUN_COMMAND:
        return "the same run again (the local backend trains inside the flow)", format_command([this_python(), *command[1:]])
    return "training command (the backend submits it as a Ray job)", format_command(command)


def format_command(command: list[str]) -> str:
    """One option or override per line, each shell-quoted, so the command can be pasted as is."""
    lines: list[list[str]] = [[shlex.quote(part) for part in command[:3]]]  # python -m module
    for part in command[3:]:
        if part.startswith("-") or ("=" in part and not lines[-1][-1].startswith("-")):
            lines.append([])
        lines[-1].append(shlex.quote(part))
    return " \\\n    ".join(" ".join(line) for line in lines)


def import_ahead(stages: list[str]) -> None:
    """Import what the later stages will need while Prefect's local API is still starting (about
    8 s on 2 cores, longer than validating the run): the seconds are spent in parallel with it
    instead of inside the export, evaluate and report stages."""
    if {"export_checkpoint", "evaluate"} & set(stages):
        import transformers.modeling_utils  # noqa: F401  (~3 s: every model class builds on it)
    if "report" in stages:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.json and not (args.dry_run or args.suggest_layout):
            raise UserError("--json only applies to --dry-run and --suggest-layout; add --dry-run")
        request = request_from_args(args)
        if args.suggest_layout:
            from grpo_pipeline.flows.suggest import print_layouts

            return print_layouts(request, args.json)
        from grpo_pipeline.stages.plan import plan_run

        if args.dry_run:
            print_dry_run(plan_run(request, dry_run=True), args.json)
            return 0
        if args.preflight:
            from grpo_pipeline.flows.node_check import check_nodes

            return check_nodes(request, plan_run(request, dry_run=True))
        # Validate everything (device usable, profile valid, run folder writable, cluster answering)
        # before a Prefect API or Ray starts; the flow uses the folder named here.
        plan = plan_run(request, dry_run=False)
        return run_flow(request.model_copy(update={"run_name": Path(plan.run_dir).name}), plan)
    except UserError as exc:
        print_error(str(exc))
        return EXIT_USER_ERROR
    except LocalAPIError as exc:
        print_error(str(exc))
        return 1


def print_error(message: str) -> None:
    """A refusal for a person: `error:` and its first line (the problem and its fix), the details below it."""
    headline, *details = scrub(message).splitlines() or [""]
    print("\n".join([f"error: {headline}", *(f"  {line}" for line in details)]), file=sys.stderr)


def run_flow(request: RunRequest, plan: RunPlan) -> int:
    """The flow run of `plan` (the flow runs what was planned and checked here), under this
    process's lease (flows/lease.py), with Prefect's local API unless one is configured. A stop
    (SIGTERM, Ctrl-C) ends it in order (Prefect marks it crashed, its hooks stop the Ray job and
    write the report) and exits with the signal's conventional code."""
    from grpo_pipeline.progress import terminal_owned
    from grpo_pipeline.flows import lease

    configured = os.environ.get("PREFECT_API_URL")
    previous = signal.signal(signal.SIGTERM, _stop_on_signal)
    try:
        with (terminal_owned(),
              lease.held(configured or f"local:{lease.prefect_home()}", required=not configured) as held,
              local_api_unless_configured(held.api_log) as api):
            from grpo_pipeline.flows.pipeline import grpo_pipeline

            if api is not None:
                import_ahead(request.stages)
                api.wait_ready()
            print_run_summary(grpo_pipeline(request, plan))
        return 0
    except BaseException as exc:
        signum = _stop_signal(exc)
        if signum is None and isinstance(exc, Exception) and not isinstance(exc, UserError):
            # A stage failed for good (its retries spent, or not retryable): the log holds its
            # traceback and the report where it stopped; the terminal gets the one line.
            said = next((line for line in str(exc).splitlines() if line.strip()), "")
            print(f"error: the run failed: {type(exc).__name__}: {scrub(said)[:1000]}; see "
                  f"{Path(plan.run_dir) / RunFolder.REPORT} for where", file=sys.stderr)
            return 1
        if signum is None:
            raise
        print(f"stopped by {signal.Signals(signum).name}; see the run's report.md for where", file=sys.stderr)
        # Ray's core (a C++ library) may abort at interpreter exit after a stop; the run is closed by
        # now (its local API stopped, its lease released), so leave without running exit handlers,
        # once what Prefect holds for a configured API is sent.
        if os.environ.get("PREFECT_API_URL"):
            flush_prefect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, previous)


class RunStopped(BaseException):
    """SIGTERM outside the flow run (inside it, Prefect raises its own TerminationSignal)."""

    def __init__(self, signum: int):
        self.signal = signum


def _stop_on_signal(signum, frame) -> None:
    raise RunStopped(signum)


def _stop_signal(exc: BaseException) -> int | None:
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    if isinstance(exc, RunStopped) or (prefect_exceptions and isinstance(exc, prefect_exceptions.TerminationSignal)):
        return exc.signal
    return None


def program() -> int:
    """The command line as a program: `python -m grpo_pipeline`, the `grpo` script, this module's `-m`."""
    try:
        return main()
    except BrokenPipeError:  # `--dry-run --json | head`: the reader left; Python's docs' way to leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(program())
