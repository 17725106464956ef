"""Datasets in verl's RL parquet schema: the built-in `arith` generator, the gsm8k and geo3k
converters, and the schema check every file passes before a run may use it.

One row per prompt, as verl's `examples/data_preprocess/gsm8k.py` writes them, read by verl's
`RLHFDataset` and by the local backend alike: `data_source` (str, selects the reward), `prompt`
(chat messages), `images` (geo3k only: list of {bytes, path}), `ability`, `reward_model`
{style: "rule", ground_truth}, `extra_info` {split, index, answer, question}.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_pipeline.errors import UserError

GSM8K_SOURCE = "openai/gsm8k"
GEO3K_SOURCE = "hiyouga/geometry3k"
ARITH_SOURCE = "arith"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
    "MUST BE put in \\boxed{}."
)
ARITH_INSTRUCTION = "Answer with the number only."

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]),
        ),
    ]
)
RL_SCHEMA_WITH_IMAGES = RL_SCHEMA.append(pa.field("images", pa.list_(IMAGE)))


class DatasetFormatError(UserError):
    """A dataset file that is not what its converter or verl expects."""


def rl_row(data_source: str, prompt: str, ground_truth: str, split: str, index: int, answer: str, question: str) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


# --- arith: the demo data, no network --------------------------------------------------------

_ARITH_TEMPLATES: list[tuple[str, Callable[[int, int], int], tuple[int, int], tuple[int, int]]] = [
    ("What is {a} + {b}?", lambda a, b: a + b, (0, 20), (0, 20)),
    ("What is {a} - {b}?", lambda a, b: a - b, (10, 30), (0, 10)),
    ("What is {a} * {b}?", lambda a, b: a * b, (1, 9), (1, 9)),
    ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?", lambda a, b: a + b, (1, 15), (1, 15)),
    ("A box holds {a} pens. {b} pens are taken out. How many pens are left?", lambda a, b: a - b, (10, 25), (1, 9)),
    ("There are {a} rows with {b} chairs in each row. How many chairs are there?", lambda a, b: a * b, (2, 9), (2, 9)),
]


def arith_problem(rng: random.Random) -> tuple[str, int]:
    text, solve, a_range, b_range = rng.choice(_ARITH_TEMPLATES)
    a, b = rng.randint(*a_range), rng.randint(*b_range)
    return text.format(a=a, b=b), solve(a, b)


def _arith_problems(split: str, rows: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, int]] | None:
    """`rows` distinct problems of a split, or None when the generator cannot find that many (it draws a
    template, then its numbers: the small templates run out first)."""
    rng = random.Random(f"arith/{seed}/{split}")
    seen, problems = set(exclude), []
    for _ in range(rows * 50):
        question, answer = arith_problem(rng)
        if question not in seen:
            seen.add(question)
            problems.append((question, answer))
            if len(problems) == rows:
                return problems
    return None


def arith_table(split: str, rows: int, seed: int, exclude: set[str] = frozenset()) -> pa.Table:
    """`rows` distinct problems, the same for the same seed and split on every machine."""
    problems = _arith_problems(split, rows, seed, exclude)
    if problems is None:
        raise DatasetFormatError(f"arith: cannot make {rows} distinct {split} problems; ask for fewer rows")
    return pa.Table.from_pylist(
        [rl_row(ARITH_SOURCE, f"{question} {ARITH_INSTRUCTION}", str(answer), split, index, str(answer), question)
         for index, (question, answer) in enumerate(problems)],
        schema=RL_SCHEMA)


def arith_rows_problem(train_rows: int, test_rows: int, seed: int) -> str | None:
    """Why the generator cannot make these splits (a run would fail at its dataset stage), naming the
    most training rows it can make beside these held-out ones; None when it can."""
    test = _arith_problems("test", test_rows, seed)
    if test is None:
        return (f"data.arith_test_rows={test_rows}: the arith generator cannot make that many distinct problems; "
                f"set data.arith_test_rows <= {_most(lambda n: _arith_problems('test', n, seed), test_rows)}")
    held_out = {question for question, _ in test}
    if _arith_problems("train", train_rows, seed, held_out) is not None:
        return None
    most = _most(lambda n: _arith_problems("train", n, seed, held_out), train_rows)
    return (f"data.arith_train_rows={train_rows}: the arith generator can make {most} distinct training problems "
            f"beside data.arith_test_rows={test_rows} held-out ones; set data.arith_train_rows <= {most} (or "
            "train for more epochs: trainer.total_epochs)")


def _most(makes, above: int) -> int:
    """The largest n below `above` for which `makes(n)` is not None (bisection: it is monotone)."""
    low, high = 0, above
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if makes(middle) is not None else (low, middle)
    return low


def arith_splits(train_rows: int, test_rows: int, seed: int) -> dict[str, pa.Table]:
    test = arith_table("test", test_rows, seed)
    # Held-out problems never appear in training.
    held_out = set(test.column("extra_info").combine_chunks().field("question").to_pylist())
    return {"train": arith_table("train", train_rows, seed, exclude=held_out), "test": test}


# --- gsm8k and geo3k converters ---------------------------------------------------------------

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_ground_truth(answer: str) -> str:
    found = _GSM8K_ANSWER.search(answer)
    if found is None:
        raise DatasetFormatError(f"gsm8k: answer without a '#### <number>' line: {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def convert_gsm8k(table: pa.Table, split: str) -> pa.Table:
    _require_columns(table, ("question", "answer"), "gsm8k (openai/gsm8k layout)")
    records = [
        rl_row(GSM8K_SOURCE, f"{q} {GSM8K_INSTRUCTION}", gsm8k_ground_truth(a), split, i, a, q)
        for i, (q, a) in enumerate(zip(table.column("question").to_pylist(), table.column("answer").to_pylist()))
    ]
    return pa.Table.from_pylist(records, schema=RL_SCHEMA)


def convert_geo3k(table: pa.Table, split: str) -> pa.Table:
    _require_columns(table, ("problem", "answer", "images"), "geo3k (hiyouga/geometry3k layout)")
    records = []
    for i, (problem, answer, images) in enumerate(
        zip(table.column("problem").to_pylist(), table.column("answer").to_pylist(), table.column("images").to_pylist())
    ):
        images = [_image_record(image) for image in images or []]
        # verl pairs each <image> placeholder with one image, in order; add any the text lacks.
        missing = len(images) - problem.count("<image>")
        text = "<image>" * max(missing, 0) + problem
        row = rl_row(GEO3K_SOURCE, f"{text} {GEO3K_INSTRUCTION}", str(answer), split, i, str(answer), problem)
        row["images"] = images
        records.append(row)
    return pa.Table.from_pylist(records, schema=RL_SCHEMA_WITH_IMAGES)


def _image_record(image) -> dict:
    if isinstance(image, dict) and image.get("bytes") is not None:
        return {"bytes": image["bytes"], "path": image.get("path")}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    raise DatasetFormatError(f"geo3k: an image is {type(image).__name__}, expected {{bytes, path}} as in the parquet layout")


def is_rl_table(table: pa.Table) -> bool:
    """Already in verl's schema (e.g. the tyzhu/geo3k files the upstream recipe downloads): such a
    file is used as it is, once it passes the check."""
    return {"prompt", "reward_model", "data_source"} <= set(table.column_names)


def _require_columns(table: pa.Table, names: tuple[str, ...], layout: str) -> None:
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise DatasetFormatError(
            f"{layout}: missing column(s) {', '.join(missing)} (found {', '.join(table.column_names)})"
        )


# --- the check ---------------------------------------------------------------------------------


def rl_schema_problems(table: pa.Table) -> list[str]:
    """Why verl's RL loader or a reward function would fail on this table (empty when it is fine)."""
    problems = []
    for field in RL_SCHEMA:
        if field.name not in table.column_names:
            problems.append(f"column {field.name!r} is missing")
    if problems:
        return problems
    if table.num_rows == 0:
        return ["the split has no rows"]
    rows = table.select([n for n in ("data_source", "prompt", "reward_model", "images") if n in table.column_names])
    for index, row in enumerate(rows.to_pylist()):
        where = f"row {index}"
        if not isinstance(row["data_source"], str) or not row["data_source"]:
            problems.append(f"{where}: data_source is empty")
        messages = row["prompt"]
        if not messages or any(
            not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str)
            for m in messages
        ):
            problems.append(f"{where}: prompt must be a non-empty list of {{role, content}} chat messages")
        else:
            placeholders = sum(m["content"].count("<image>") for m in messages)
            images = row.get("images") or []
            if placeholders != len(images):
                problems.append(f"{where}: {placeholders} <image> placeholder(s) for {len(images)} image(s)")
        reward = row["reward_model"] or {}
        if reward.get("ground_truth") in (None, ""):
            problems.append(f"{where}: reward_model.ground_truth is empty")
        if len(problems) >= 5:
            problems.append("...")
            break
    return problems


def check_rl_file(path: Path) -> int:
    """Rows of a verified RL parquet file, or DatasetFormatError naming the file and the problem."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetFormatError(f"{path}: not a readable parquet file ({exc})") from exc
    problems = rl_schema_problems(table)
    if problems:
        raise DatasetFormatError(f"{path}: {'; '.join(problems)}")
    return table.num_rows
