"""Score the stored responses with a reference harness, lm-evaluation-harness, in a venv of its own.

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install "lm-eval[math]==0.4.13"
    /tmp/refvenv/bin/python tools/agreement/reference_scores.py    # writes tests/data/agreement/reference.json

Why a venv of its own: lm-eval's MATH scorer (tasks/minerva_math/utils.py) asserts antlr4-python3-runtime
4.11 at import, and the project's hydra-core 1.3 (verl's config) pins antlr 4.9.3, so both cannot share one
environment; tests/test_agreement.py compares the project's scores with the ones this writes.

lm-eval's own evaluator runs (`simple_evaluate`): its task files for `gsm8k` and `minerva_math500` are included
as they ship, with the data read from the stored cases (`dataset_path: json`, no hub) and no few-shot examples,
and a model that answers each document with its stored response (`Replay`). Per-sample scores are read from
its logged samples: gsm8k's `exact_match` under the `strict-match` filter (the `#### <number>` rule that verl's
and this project's gsm8k reward follow), minerva_math500's `math_verify` (math-verify, as this project grades
MATH answers; its `exact_match` needs Minerva's "Final Answer:" sentence and is recorded for reference).
"""

from __future__ import annotations

import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "agreement"
TASKS = Path(sys.modules["lm_eval"].__file__).parent / "tasks"
# (our task name, the shipped task file it includes, the stored cases)
BENCHMARKS = {
    "agreement_gsm8k": (TASKS / "gsm8k" / "gsm8k.yaml", DATA / "gsm8k.jsonl"),
    "agreement_math500": (TASKS / "minerva_math" / "minerva_math500.yaml", DATA / "math500.jsonl"),
}


class Replay(LM):
    """A model whose answer to document i of a task is the stored response of case i."""

    def __init__(self, responses: dict[str, list[str]]):
        super().__init__()
        self.responses = responses

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self.responses[request.task_name][request.doc_id] for request in requests]

    # lm-eval's LM declares these too; the agreement tasks (gsm8k, minerva_math500) only generate, and a
    # replay of stored responses has no likelihoods to give.
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise TypeError("Replay answers generate_until requests only: the agreement tasks are generation tasks")

    loglikelihood_rolling = loglikelihood


def main() -> None:
    cases = {name: [json.loads(line) for line in file.read_text().splitlines()] for name, (_, file) in BENCHMARKS.items()}
    with tempfile.TemporaryDirectory() as folder:
        for name, (shipped, file) in BENCHMARKS.items():
            Path(folder, f"{name}.yaml").write_text(
                f"include: {shipped}\ntask: {name}\ntag: []\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    test: {file}\ntraining_split: null\nfewshot_split: null\n"
                "test_split: test\nnum_fewshot: 0\n")
        results = simple_evaluate(model=Replay({name: [c["response"] for c in rows] for name, rows in cases.items()}),
                                  tasks=list(BENCHMARKS), task_manager=TaskManager(include_path=folder),
                                  log_samples=True, bootstrap_iters=0)
    scores: dict[str, dict[str, dict]] = {}
    for name, samples in results["samples"].items():
        benchmark = name.removeprefix("agreement_")
        for sample in samples:
            case = cases[name][sample["doc_id"]]
            entry = scores.setdefault(benchmark, {}).setdefault(case["id"], {})
            if benchmark == "gsm8k":
                entry[sample["filter"]] = {"exact_match": sample["exact_match"], "extracted": sample["filtered_resps"][0]}
            else:
                entry.update(math_verify=sample["math_verify"], exact_match=sample["exact_match"])
    out = {
        "harness": f"lm-eval {version('lm_eval')}",
        "versions": {name: version(name) for name in ("lm_eval", "math-verify", "latex2sympy2_extended", "sympy",
                                                      "antlr4-python3-runtime")},
        "command": "/tmp/refvenv/bin/python tools/agreement/reference_scores.py",
        "aggregates": {name.removeprefix("agreement_"): values for name, values in results["results"].items()},
        "scores": scores,
    }
    (DATA / "reference.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(out["aggregates"], indent=1))


if __name__ == "__main__":
    main()
