"""Serve the pipeline's deployments from this process, for users without a work pool or worker.

    python -m grpo_pipeline.flows.serve                          # the local-smoke deployment of prefect.yaml
    python -m grpo_pipeline.flows.serve qwen3.5-122b-a10b-npu    # any deployments of prefect.yaml, by name
    python -m grpo_pipeline.flows.serve --all

The deployments (description, parameters, schedules, concurrency limit) are those of prefect.yaml;
this process registers them with the Prefect API (PREFECT_API_URL), polls for their runs (scheduled
or triggered from the UI) and runs each in a subprocess. Runs inherit this process's environment, not
prefect.yaml's `job_variables.env`: export RAY_ADDRESS, HF_ENDPOINT and secrets before starting it.
Stop it with Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from grpo_pipeline.errors import UserError

PREFECT_YAML = Path(__file__).resolve().parents[2] / "prefect.yaml"  # the checkout's, beside pyproject.toml
EXIT_USER_ERROR = 2


def deployments_in(path: Path, names: list[str] | None) -> list[dict]:
    """The deployment entries of prefect.yaml named in `names` (all when None)."""
    entries = yaml.safe_load(path.read_text())["deployments"]
    if names is None:
        return entries
    known = {entry["name"]: entry for entry in entries}
    if unknown := [name for name in names if name not in known]:
        raise UserError(f"no deployment named {', '.join(unknown)} in {path}; the deployments are {', '.join(known)}")
    return [known[name] for name in names]


def to_runner_deployment(entry: dict):
    from prefect.schedules import Cron

    from grpo_pipeline.flows.form import run_from_form

    schedules = [
        Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True)) for s in entry.get("schedules") or []
    ]
    return run_from_form.to_deployment(
        name=entry["name"],
        description=entry.get("description"),
        tags=entry.get("tags"),
        parameters=entry.get("parameters"),
        schedules=schedules,
        concurrency_limit=entry.get("concurrency_limit"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_pipeline.flows.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="deployments of prefect.yaml to serve (default: local-smoke)")
    parser.add_argument("--all", action="store_true", help="serve every deployment of prefect.yaml")
    parser.add_argument("--limit", type=int, default=1, help="flow runs at once across them (default: 1)")
    args = parser.parse_args(argv)
    try:
        entries = deployments_in(PREFECT_YAML, None if args.all else (args.names or ["local-smoke"]))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    from prefect import serve

    serve(*(to_runner_deployment(entry) for entry in entries), limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
