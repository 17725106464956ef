"""Any hub or local dataset as verl's RL rows, by column mapping (`data.dataset=mapped`, `data.columns`).

    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=mapped --set data.source=/path/to/qa \\
        --set data.columns.prompt=question --set data.columns.answer=final --stages fetch_dataset

The prompt is a text column (put into `data.columns.template` at `{prompt}`, after `data.columns.system_prompt`)
or a chat messages column; the answer column becomes `reward_model.ground_truth`; every other column of a row
is kept in `extra_info` (TRL-style rewards get each as a keyword argument). Checked before anything is written:
the columns exist and have the right types, and no row's prompt or answer is empty (the first rows that are
are named, and the count given).
"""

from __future__ import annotations

import pyarrow as pa

from grpo_pipeline.data.rl_data import DatasetFormatError

NAMED_ROWS = 5


def convert_mapped(table: pa.Table, split: str, columns, data_source: str) -> pa.Table:
    """`columns` is the profile's DataColumns."""
    prompt_column = columns.messages or columns.prompt
    missing = [c for c in (prompt_column, columns.answer) if c not in table.column_names]
    if missing:
        raise DatasetFormatError(f"data.columns: {split} split has no column {', '.join(map(repr, missing))} (its columns: "
                                 f"{', '.join(table.column_names)})")
    problems, empty = [], []
    records = []
    for index, row in enumerate(table.to_pylist()):
        prompt, answer = row[prompt_column], row[columns.answer]
        messages = _messages(prompt, columns, index, problems)
        if messages is None or answer is None or str(answer).strip() == "":
            empty.append(index)
            continue
        extra = {key: _plain(value) for key, value in row.items() if key not in (prompt_column, columns.answer)}
        question = messages[-1]["content"]
        records.append({
            "data_source": data_source, "prompt": messages, "ability": "custom",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {**extra, "split": split, "index": index, "answer": str(answer), "question": question},
        })
    if problems:
        raise DatasetFormatError(f"data.columns: {split} split: {'; '.join(problems[:NAMED_ROWS])}")
    if empty:
        raise DatasetFormatError(
            f"data.columns: {len(empty)} of {table.num_rows} {split} rows have an empty prompt or answer (rows "
            f"{', '.join(map(str, empty[:NAMED_ROWS]))}{', ...' if len(empty) > NAMED_ROWS else ''}); drop them from the source")
    # extra_info's fields are the source's own columns beside verl's four: its type is read from the rows.
    return pa.Table.from_pylist(records)


def _messages(prompt, columns, index: int, problems: list[str]) -> list[dict] | None:
    if columns.messages:
        if prompt is None or prompt == []:
            return None
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   and m.get("role") in ("system", "user", "assistant") for m in prompt):
            problems.append(f"row {index}: column {columns.messages!r} is not a list of {{role, content}} messages")
            return None
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
            return None
        if not isinstance(prompt, str):
            problems.append(f"row {index}: column {columns.prompt!r} is a {type(prompt).__name__}, not text (a chat "
                            "messages column is data.columns.messages)")
            return None
        text = columns.template.replace("{prompt}", prompt) if columns.template else prompt
        messages = [{"role": "user", "content": text}]
    if columns.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": columns.system_prompt}, *messages]
    return messages


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
