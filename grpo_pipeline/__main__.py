"""`python -m grpo_pipeline`: the command line (flows/grpo.py; the `grpo` script once installed).

    python -m grpo_pipeline --model tiny --device cpu --dry-run
"""

import sys

from grpo_pipeline.flows.grpo import program

sys.exit(program())
