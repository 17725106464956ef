"""The agreement table: the pipeline's scores of the stored responses beside the reference harness's.

    .venv/bin/python tools/agreement/compare.py    # prints the table (docs/evaluation.md has it)

The pipeline scores each response as its evaluation stage does (rewards/plan.py `RewardParts` with the built-in
reward of the benchmark's data_source: math-verify for MATH-500, verl's strict `#### <number>` rule for GSM8K);
the reference scores are lm-eval 0.4.13's, stored by tools/agreement/reference_scores.py. Where they differ by
rule, `KNOWN_DIFFERENCES` says why; tests/test_agreement.py holds the pipeline to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_pipeline.rewards.plan import RewardParts, RewardPlan, batch_of

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "agreement"
# benchmark -> (data_source of its rows, the stored field that is the ground truth, the reference's metric)
BENCHMARKS = {
    "math500": ("HuggingFaceH4/MATH-500", "answer", "math_verify"),
    "gsm8k": ("openai/gsm8k", "ground_truth", "strict-match exact_match"),
}
# Response forms where GSM8K's two rules differ by design. The pipeline keeps verl's `reward_score/gsm8k.py`
# (checked against verl's own function in tests/test_rewards.py); lm-eval's strict-match differs in three ways.
KNOWN_DIFFERENCES = {
    "marker-period": "`#### 72.`: lm-eval drops a trailing period (regexes_to_ignore `\\.$`); verl compares `72.`",
    "marker-twice-first-right": "two `####` answers: lm-eval takes the first (take_first), verl the last",
    "marker-twice-last-right": "two `####` answers: lm-eval takes the first (take_first), verl the last",
    "marker-early": "`####` more than 300 characters before the end: verl reads only the last 300 characters",
}


def cases(benchmark: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{benchmark}.jsonl").read_text().splitlines()]


def reference() -> dict:
    return json.loads((DATA / "reference.json").read_text())


def pipeline_scores(benchmark: str) -> dict[str, bool]:
    """Each stored response's verdict (correct or not) by the evaluation stage's own scoring."""
    source, truth, _ = BENCHMARKS[benchmark]
    rows = cases(benchmark)
    scored = RewardParts(RewardPlan()).score(batch_of(
        [{"prompt": [{"role": "user", "content": row.get("problem") or row["question"]}], "data_source": source,
          "ground_truth": row[truth]} for row in rows], [row["response"] for row in rows]))
    return {row["id"]: bool(correct) for row, correct in zip(rows, scored.correct)}


def reference_scores(benchmark: str) -> dict[str, bool]:
    scores = reference()["scores"][benchmark]
    if benchmark == "gsm8k":
        return {case: bool(entry["strict-match"]["exact_match"]) for case, entry in scores.items()}
    return {case: bool(entry["math_verify"]) for case, entry in scores.items()}


def form_of(case_id: str) -> str:
    return case_id.split("-", 2)[2]


def agreement(benchmark: str) -> dict:
    """Per benchmark: accuracy both ways, the responses that agree, and those that do not, by form."""
    ours, theirs = pipeline_scores(benchmark), reference_scores(benchmark)
    differ = sorted(case for case in ours if ours[case] != theirs[case])
    explained = [case for case in differ if form_of(case) in KNOWN_DIFFERENCES]
    outside = [case for case in ours if form_of(case) not in KNOWN_DIFFERENCES]
    return {
        "responses": len(ours), "pipeline": sum(ours.values()) / len(ours), "reference": sum(theirs.values()) / len(ours),
        "agree": len(ours) - len(differ), "differ": differ, "unexplained": [c for c in differ if c not in explained],
        "typical": len(outside), "typical_pipeline": sum(ours[c] for c in outside) / max(1, len(outside)),
        "typical_reference": sum(theirs[c] for c in outside) / max(1, len(outside)),
        "forms": sorted({form_of(case) for case in differ}),
    }


def table() -> str:
    ref = reference()
    lines = [f"Reference: {ref['harness']} ({', '.join(f'{k} {v}' for k, v in sorted(ref['versions'].items()))}).", "",
             "| benchmark | reference metric | responses | agree | pipeline accuracy | reference accuracy | "
             "outside the known differences: responses, pipeline / reference | differing forms |",
             "|---|---|---|---|---|---|---|---|"]
    for benchmark, (_, _, metric) in BENCHMARKS.items():
        a = agreement(benchmark)
        lines.append(f"| {benchmark} | {metric} | {a['responses']} | {a['agree']} ({a['agree'] / a['responses']:.1%}) | "
                     f"{a['pipeline']:.3f} | {a['reference']:.3f} | {a['typical']}: {a['typical_pipeline']:.3f} / "
                     f"{a['typical_reference']:.3f} | {', '.join(a['forms']) or 'none'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    for form, why in KNOWN_DIFFERENCES.items():
        print(f"- {form}: {why}")
