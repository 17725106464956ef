"""Small datasets in the layouts the real sources publish, made in-process (no hub)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def gsm8k_table(rows: int, offset: int = 0) -> pa.Table:
    """openai/gsm8k's `main` config: question, answer ending in `#### <number>`."""
    questions = [f"Natalia sold {n + offset} clips in April and twice as many in May. How many in all?" for n in range(rows)]
    answers = [f"She sold {n + offset} * 2 = {2 * (n + offset)} in May.\n#### {3 * (n + offset) * 1000:,}" for n in range(rows)]
    return pa.table({"question": questions, "answer": answers})


def png(size: int, colour: int) -> bytes:
    sink = io.BytesIO()
    Image.new("RGB", (size, size), (colour, 0, 255 - colour)).save(sink, format="PNG")
    return sink.getvalue()


def geo3k_table(rows: int) -> pa.Table:
    """hiyouga/geometry3k: images (list of {bytes, path}), problem with an <image> placeholder, answer."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table(
        {
            "images": pa.array([[{"bytes": png(8 + n, 10 * n), "path": None}] for n in range(rows)], pa.list_(image)),
            "problem": [f"<image>Find x. The angle is {30 + n} degrees." for n in range(rows)],
            "answer": [str(60 - n) for n in range(rows)],
        }
    )


def gsm8k_repo_files(rows: int = 12) -> dict[str, bytes]:
    return {
        "main/train-00000-of-00001.parquet": parquet_bytes(gsm8k_table(rows)),
        "main/test-00000-of-00001.parquet": parquet_bytes(gsm8k_table(4, offset=100)),
        # Another config of the same repo, which must not be mixed in.
        "socratic/train-00000-of-00001.parquet": parquet_bytes(gsm8k_table(3, offset=500)),
        "README.md": b"# gsm8k\n",
    }


def geo3k_repo_files(rows: int = 6) -> dict[str, bytes]:
    return {
        "data/train-00000-of-00001.parquet": parquet_bytes(geo3k_table(rows)),
        "data/validation-00000-of-00001.parquet": parquet_bytes(geo3k_table(2)),
        "data/test-00000-of-00001.parquet": parquet_bytes(geo3k_table(3)),
    }


# --- the math datasets, in the layouts their hub repos publish (data/math_data.py) -----------------

MATH_ANSWERS = ["\\frac{1}{2}", "3\\sqrt{2}", "[2,5)", "24", "-\\frac{2}{3}", "10", "\\pi", "(1,2)"]


def math_rows(rows: int, offset: int = 0) -> list[dict]:
    """MATH's columns (DigitalLearningGmbH/MATH-lighteval): the answer only inside the solution's \\boxed{}."""
    return [{"problem": f"Problem {n + offset}: compute the value.", "level": f"Level {1 + n % 5}",
             "solution": f"Work it out step by step, so the value is $\\boxed{{{MATH_ANSWERS[(n + offset) % len(MATH_ANSWERS)]}}}$.",
             "type": ["Algebra", "Geometry", "Prealgebra"][n % 3]} for n in range(rows)]


def math_repo_files(train: int = 16, test: int = 6) -> dict[str, bytes]:
    return {"data/train-00000-of-00001.parquet": parquet_bytes(pa.Table.from_pylist(math_rows(train))),
            "data/test-00000-of-00001.parquet": parquet_bytes(pa.Table.from_pylist(math_rows(test, offset=1000))),
            "README.md": b"# MATH-lighteval\n"}


def math500_rows(rows: int = 8) -> list[dict]:
    """HuggingFaceH4/MATH-500's test.jsonl: problem, solution, answer, subject, level, unique_id."""
    return [{"problem": f"MATH-500 problem {n}: find the value.", "answer": MATH_ANSWERS[n % len(MATH_ANSWERS)],
             "solution": f"Hence $\\boxed{{{MATH_ANSWERS[n % len(MATH_ANSWERS)]}}}$.", "subject": "Algebra",
             "level": 1 + n % 5, "unique_id": f"test/algebra/{n}.json"} for n in range(rows)]


def math500_repo_files(rows: int = 8) -> dict[str, bytes]:
    import json

    return {"test.jsonl": "".join(json.dumps(row) + "\n" for row in math500_rows(rows)).encode(), "README.md": b"# MATH-500\n"}


def aime_repo_files(year: int, rows: int = 6) -> dict[str, bytes]:
    """HuggingFaceH4/aime_2024 and yentinglin/aime_2025: id, problem, solution, answer, url, year."""
    table = pa.Table.from_pylist([{"id": n, "problem": f"AIME {year} problem {n}.", "solution": f"... so {100 + n}.",
                                   "answer": str(100 + n), "url": f"https://example.org/{year}/{n}", "year": str(year)}
                                  for n in range(rows)])
    return {"data/train-00000-of-00001.parquet": parquet_bytes(table)}


def dapo_repo_files(unique: int = 12, copies: int = 3, interleaved: bool = False) -> dict[str, bytes]:
    """BytedTsinghua-SIA/DAPO-Math-17k's one file: verl's schema already, each prompt repeated (one after
    another, or `interleaved`: the whole set again and again)."""
    instruction = ("Solve the following math problem step by step. The last line of your response should be of the form "
                   "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
    rows = [{"data_source": "math_dapo", "prompt": [{"content": f"{instruction}What is {n} + {n}?", "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * n), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"uuid-{n}"}} for n in range(unique) for _ in range(copies)]
    if interleaved:
        rows = [rows[n * copies] for _ in range(copies) for n in range(unique)]
    return {"data/dapo-math-17k.parquet": parquet_bytes(pa.Table.from_pylist(rows))}
