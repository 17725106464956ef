"""The fast generation paths give what the eager path gives. Transformers' compiled decoding
(`generation.cache: static` + `generation.compile: true`): a greedy run on `tiny` (CPU, where
transformers compiles only when asked) produces the same tokens, per-token log-probs within float
tolerance and the same rewards, both with the generation config TRL builds for rollouts and through
the evaluation stage. The native decoder compiled (inductor, FlexAttention; the GPU's step without its
CUDA graph) produces `generate`'s greedy tokens, and a second process loads its compiled step from
the compile cache instead of compiling it. The compiling happens in child processes
(tests/fast_generation_check.py, tests/native_compile_check.py): see their docstrings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[1] / "fast_generation_check.py"
NATIVE_CHECK = Path(__file__).resolve().parents[1] / "native_compile_check.py"


def test_compiled_decoding_gives_the_eager_tokens_logprobs_rewards_and_evaluation(tiny_model_dir):
    done = subprocess.run([sys.executable, str(CHECK), str(tiny_model_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"]
    assert result["max_logprob_difference"] <= 1e-4
    assert result["rewards"][0] == result["rewards"][1]
    assert result["evaluation_responses_equal"]


def test_the_compiled_native_decoder_gives_generates_tokens_and_compiles_once_per_machine(tiny_model_dir, tmp_path):
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile-cache")}
    results = []
    for _ in range(2):  # two runs of the same model on this machine
        done = subprocess.run([sys.executable, str(NATIVE_CHECK), str(tiny_model_dir)], capture_output=True, text=True,
                              timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = results
    assert first["tokens_equal"] and first["rows_differ"] and "compiled step, flex attention" in first["path"]
    assert first["fx_graph_cache_miss"] >= 3 and first["fx_graph_cache_hit"] == 0  # prologue, layer, head compiled
    assert second["tokens_equal"] and second["fx_graph_cache_hit"] >= 3 and second["fx_graph_cache_miss"] == 0
