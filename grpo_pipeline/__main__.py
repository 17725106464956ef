"""`python -m grpo_pipeline`: the command line (flows/grpo.py; the `grpo` script once installed).

    .venv/bin/python -m grpo_pipeline --model tiny --device cpu --dry-run

A Python without the project's dependencies (the system's, outside `.venv`) gets one line that says so
and which interpreter has them, instead of an import's traceback.
"""

import sys

try:
    from grpo_pipeline.flows.grpo import program
except ModuleNotFoundError as exc:
    if (exc.name or "grpo_pipeline").split(".")[0] == "grpo_pipeline":
        raise  # the project's own module missing is a bug, not a set-up to fix
    print(f"error: this Python ({sys.executable}) lacks grpo_pipeline's dependencies (no module {exc.name!r}); "
          "run .venv/bin/python -m grpo_pipeline (make setup builds it)", file=sys.stderr)
    sys.exit(2)

sys.exit(program())
