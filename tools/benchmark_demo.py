"""The benchmark demo: train on MATH-500-format data, evaluate every saved checkpoint on MATH-500, AIME 2024 and
GSM8K, and choose the best, on the CPU with no network.

    .venv/bin/python tools/benchmark_demo.py                      # smollm2-135m, 6 GRPO steps (10 min on 2 idle
                                                                  # cores; 37 min was seen at a load of 11-18)
    .venv/bin/python tools/benchmark_demo.py --model tiny --steps 4   # the plumbing only (a random model scores 0)

Each model has a run name of its own (`benchmark-demo-<model>`): a run folder holds one run (run/identity.py).

The datasets are served from the fake hub of the tests (tests/hub_server.py on 127.0.0.1, the real
`huggingface_hub` client fetching them) in the layouts their repos publish: HuggingFaceH4/MATH-500's
`test.jsonl`, HuggingFaceH4/aime_2024's parquet, openai/gsm8k's `main/` parquet. The problems are short
arithmetic written here, so a 135M model solves some of them; everything after the download is the
pipeline as a user runs it: `python -m grpo_pipeline ... --set 'eval.benchmarks=[math500,aime24,gsm8k]'
--set eval.checkpoints=all`. The run's report (`runs/<run>/report.md`) has the per-benchmark tables.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from hub_server import HubServer  # noqa: E402  (the tests' fake hub)


def _parquet(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def problems(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        op = rng.choice(["+", "-", "\\times"])
        out.append((f"What is ${a} {op} {b}$?", a + b if op == "+" else a - b if op == "-" else a * b))
    return out


def repos(seed: int) -> dict[str, dict[str, bytes]]:
    """Each benchmark's files in its published layout."""
    math500 = [{"problem": problem, "solution": f"Computing, ${problem[9:-2]} = \\boxed{{{answer}}}$.",
                "answer": str(answer), "subject": "Prealgebra", "level": 1, "unique_id": f"test/prealgebra/{i}.json"}
               for i, (problem, answer) in enumerate(problems(48, seed))]
    aime = [{"id": i, "problem": problem, "solution": f"... so {answer}.", "answer": str(answer),
             "url": f"https://example.org/aime/{i}", "year": "2024"} for i, (problem, answer) in enumerate(problems(12, seed + 1))]
    gsm8k = [{"question": f"Sam has {a} apples and buys {b} more. How many apples does he have?",
              "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
             for a, b in ((random.Random(seed + i).randint(2, 40), random.Random(seed - i).randint(2, 40)) for i in range(16))]
    return {
        "HuggingFaceH4/MATH-500": {"test.jsonl": "".join(json.dumps(row) + "\n" for row in math500).encode()},
        "HuggingFaceH4/aime_2024": {"data/train-00000-of-00001.parquet": _parquet(aime)},
        "openai/gsm8k": {"main/train-00000-of-00001.parquet": _parquet(gsm8k[:8]),
                         "main/test-00000-of-00001.parquet": _parquet(gsm8k[8:])},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--run-name", help="default: benchmark-demo-<model> (a run folder holds one model's run)")
    parser.add_argument("--run-dir", default=str(ROOT / "runs"))
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], help="more profile overrides")
    args = parser.parse_args()
    with HubServer() as hub, tempfile.TemporaryDirectory() as hf_home:
        for repo, files in repos(seed=0).items():
            hub.add_repo(repo, files)
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=hf_home, HF_HUB_DISABLE_TELEMETRY="1")
        env.pop("HF_HUB_OFFLINE", None)
        overrides = [
            "data.dataset=math500", f"data.root={Path(args.run_dir) / 'data'}",
            "data.max_response_length=48", f"trainer.total_training_steps={args.steps}",
            f"trainer.save_freq={args.save_freq}", f"trainer.total_epochs={args.steps}",
            "eval.benchmarks=[math500,aime24,gsm8k]", "eval.checkpoints=all", "eval.best_metric=math500/pass@1",
            "eval.samples_per_prompt=4", "eval.temperature=1.0", f"eval.max_prompts={args.max_prompts}", *args.set,
        ]
        command = [sys.executable, "-m", "grpo_pipeline", "--model", args.model, "--device", "cpu", "--run-dir",
                   args.run_dir, "--run-name", args.run_name or f"benchmark-demo-{Path(args.model).name}", *(part for o in overrides for part in ("--set", o))]
        print("$", " ".join(command), flush=True)
        return subprocess.call(command, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
