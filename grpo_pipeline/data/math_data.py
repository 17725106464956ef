"""The math datasets people train and report on, and any dataset by column mapping, converted to verl's
RL parquet schema (data/rl_data.py).

    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=math --stages fetch_dataset
    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=math500 --stages fetch_dataset

Each built-in is fetched from its hub repo in the layout published there (tests/datasets_fixtures.py serves
the same layouts from the fake hub):

| name | repo | files | columns | splits |
|---|---|---|---|---|
| math | DigitalLearningGmbH/MATH-lighteval (verl's MATH source) | data/{train,test}-*.parquet | problem, level, solution, type | 7,500 / 5,000 |
| math500 | HuggingFaceH4/MATH-500 | test.jsonl | problem, solution, answer, subject, level, unique_id | 500 (evaluation) |
| dapo17k | BytedTsinghua-SIA/DAPO-Math-17k | data/dapo-math-17k.parquet | verl's RL schema already | 17,917 unique prompts |
| aime24 | HuggingFaceH4/aime_2024 | data/train-*.parquet | id, problem, solution, answer, url, year | 30 (evaluation) |
| aime25 | yentinglin/aime_2025 | data/train-*.parquet | id, problem, solution, answer, url, year | 30 (evaluation) |

The prompt is verl's (`examples/data_preprocess/math_dataset.py`): the problem, then "Let's think step by step
and output the final answer within \\boxed{}."; MATH's ground truth is its solution's last `\\boxed{}`, as there.
An evaluation set (one split) is both splits; DAPO-Math-17k (one split, each prompt repeated in the published
file) is deduplicated, its last `HELD_OUT_ROWS` prompts held out as the test split (`hold_out`: by prompt, so
no held-out prompt is trained on, as any one-split source).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from grpo_pipeline.data.rl_data import RL_SCHEMA, DatasetFormatError, rl_row
from grpo_pipeline.profiles.datasets import DATA_SOURCES
from grpo_pipeline.rewards.builtin import boxed_content

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
HELD_OUT_ROWS = 256


def convert_problems(table: pa.Table, split: str, data_source: str, answer_of: Callable[[dict], str]) -> pa.Table:
    """Rows with a `problem` column (MATH, MATH-500, AIME) as verl's math rows."""
    if "problem" not in table.column_names:
        raise DatasetFormatError(f"{data_source}: no 'problem' column (found {', '.join(table.column_names)})")
    records = []
    for index, row in enumerate(table.to_pylist()):
        truth = answer_of(row)
        if truth in (None, ""):
            raise DatasetFormatError(f"{data_source} {split} row {index}: no answer (a solution without \\boxed{{}}?)")
        records.append(rl_row(data_source, f"{row['problem']} {MATH_INSTRUCTION}", str(truth), split, index,
                              str(truth), row["problem"]))
    return pa.Table.from_pylist(records, schema=RL_SCHEMA)


def boxed_answer(row: dict) -> str | None:
    return boxed_content(row.get("solution") or "")


def stated_answer(row: dict) -> str | None:
    answer = row.get("answer")
    return None if answer is None else str(answer).strip()


def convert_dapo(table: pa.Table, split: str) -> pa.Table:
    """DAPO-Math-17k's file is verl's schema already, each prompt repeated: one row per prompt, its prompt as
    published, our extra_info."""
    records, seen = [], set()
    for row in table.select(["data_source", "prompt", "reward_model"]).to_pylist():
        question = row["prompt"][-1]["content"]
        if question in seen:
            continue
        seen.add(question)
        truth = str(row["reward_model"]["ground_truth"])
        record = rl_row(row["data_source"], question, truth, split, len(records), truth, question)
        record["prompt"] = row["prompt"]
        records.append(record)
    return pa.Table.from_pylist(records, schema=RL_SCHEMA)


def _problems(data_source: str, answer_of) -> Callable[[pa.Table, str], pa.Table]:
    return lambda table, split: convert_problems(table, split, data_source, answer_of)


# The converter of each built-in math dataset (its repo and files: profiles/datasets.py SOURCES).
CONVERTERS: dict[str, Callable[[pa.Table, str], pa.Table]] = {
    "math": _problems(DATA_SOURCES["math"], boxed_answer),
    "math500": _problems(DATA_SOURCES["math500"], stated_answer),
    "dapo17k": convert_dapo,
    "aime24": _problems(DATA_SOURCES["aime24"], stated_answer),
    "aime25": _problems(DATA_SOURCES["aime25"], stated_answer),
}


def complete_splits(tables: dict[str, pa.Table], evaluation_only: bool, source: str) -> dict[str, pa.Table] | None:
    """Train and test from what the source has: both as published; an evaluation set's one split is both;
    None for a source with only a training split, whose test split `hold_out` makes once it is converted."""
    if "train" in tables and "test" in tables:
        return tables
    only = tables.get("train", tables.get("test"))
    if only is None:
        raise DatasetFormatError(f"{source}: no train or test split among its files")
    return {"train": only, "test": only} if evaluation_only else None


def hold_out(converted: pa.Table, source: str) -> dict[str, pa.Table]:
    """The last prompts (at most HELD_OUT_ROWS, a tenth of the distinct ones) of a converted one-split source as
    its test split, by prompt, not by row: a prompt repeated in the file (DAPO-Math-17k's interleaved copies)
    is held out with every copy, so no held-out prompt is trained on."""
    prompts = [_prompt_key(p) for p in converted.column("prompt").to_pylist()]
    distinct = list(dict.fromkeys(prompts))
    count = min(HELD_OUT_ROWS, len(distinct) // 10)
    if count == 0:
        raise DatasetFormatError(f"{source}: {len(distinct)} distinct prompts and no test split; give a "
                                 "test*.parquet file too")
    held = set(distinct[-count:])
    first = {key: index for index, key in reversed(list(enumerate(prompts)))}
    train = converted.filter(pa.array([key not in held for key in prompts]))
    test = converted.take(sorted(first[key] for key in held)).to_pylist()
    for index, row in enumerate(test):
        row["extra_info"] = {**row["extra_info"], "split": "test", "index": index}
    splits = {"train": train, "test": pa.Table.from_pylist(test, schema=converted.schema)}
    if overlap := held_out_overlap(splits):
        raise DatasetFormatError(f"{source}: {overlap} held-out prompts are also training prompts")
    return splits


def held_out_overlap(splits: dict[str, pa.Table]) -> int:
    """How many of the test split's prompts the train split holds too."""
    train = {_prompt_key(p) for p in splits["train"].column("prompt").to_pylist()}
    return sum(_prompt_key(p) in train for p in splits["test"].column("prompt").to_pylist())


def _prompt_key(messages: list[dict]) -> str:
    return "\x1e".join(f"{m.get('role')}\x1f{m.get('content')}" for m in messages)
