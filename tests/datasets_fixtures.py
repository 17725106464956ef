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
