"""The fast generation path (`generation.cache: static` + `generation.compile: true`, the GPU
default) gives what the eager path gives: a greedy run on `tiny` (CPU, where transformers compiles
only when asked) produces the same tokens, per-token log-probs within float tolerance and the same
rewards, both with the generation config TRL builds for rollouts and through the evaluation stage.
The compiling happens in a child process (tests/fast_generation_check.py): see its docstring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[1] / "fast_generation_check.py"


def test_compiled_decoding_gives_the_eager_tokens_logprobs_rewards_and_evaluation(tiny_model_dir):
    done = subprocess.run([sys.executable, str(CHECK), str(tiny_model_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"]
    assert result["max_logprob_difference"] <= 1e-4
    assert result["rewards"][0] == result["rewards"][1]
    assert result["evaluation_responses_equal"]
