"""The math datasets and any dataset by column mapping, fetched from the fake hub on 127.0.0.1 in the
layouts their repos publish (tests/datasets_fixtures.py), converted to verl's RL schema and verified."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets_fixtures import (aime_repo_files, dapo_repo_files, math500_repo_files, math_repo_files, parquet_bytes)
from test_fetch_hub import data_spec, hub  # noqa: F401  (the fake hub fixture)
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.datasets import DataColumns
from grpo_pipeline.rewards.builtin import score
from grpo_pipeline.stages.dataset import fetch_dataset


@pytest.mark.parametrize(("name", "repo", "files", "rows", "source", "truth"), [
    ("math", "DigitalLearningGmbH/MATH-lighteval", math_repo_files(), {"train": 16, "test": 6},
     "DigitalLearningGmbH/MATH-lighteval", "\\frac{1}{2}"),
    ("math500", "HuggingFaceH4/MATH-500", math500_repo_files(), {"train": 8, "test": 8}, "HuggingFaceH4/MATH-500",
     "\\frac{1}{2}"),
    ("aime24", "HuggingFaceH4/aime_2024", aime_repo_files(2024), {"train": 6, "test": 6}, "aime24", "100"),
    ("aime25", "yentinglin/aime_2025", aime_repo_files(2025), {"train": 6, "test": 6}, "aime25", "100"),
    ("dapo17k", "BytedTsinghua-SIA/DAPO-Math-17k", dapo_repo_files(unique=12, copies=3), {"train": 11, "test": 1},
     "math_dapo", "0"),
])
@pytest.mark.e2e  # starts the fake Hub (a server on 127.0.0.1)
def test_each_math_dataset_from_its_published_layout(hub, tmp_path, name, repo, files, rows, source, truth):  # noqa: F811
    hub.add_repo(repo, files)
    fetched = fetch_dataset(data_spec(tmp_path, dataset=name))
    assert fetched.rows == rows
    first = pq.read_table(fetched.train_files[0]).to_pylist()[0]
    assert first["data_source"] == source and first["reward_model"]["ground_truth"] == truth
    assert first["prompt"][-1]["role"] == "user"
    # The built-in reward of the rows' data_source grades a right answer right (math-verify).
    assert score(source, f"so the answer is \\boxed{{{truth}}}", truth).correct
    hub.reset_requests()
    assert fetch_dataset(data_spec(tmp_path, dataset=name)).cached and hub.requests == []


@pytest.mark.e2e  # starts the fake hub
def test_a_held_out_prompt_is_never_trained_on_however_the_file_repeats_it(hub, tmp_path):  # noqa: F811
    """Issue 55: the last rows were held out before deduplication, so with interleaved copies every held-out
    prompt was also a training prompt."""
    hub.add_repo("BytedTsinghua-SIA/DAPO-Math-17k", dapo_repo_files(unique=30, copies=3, interleaved=True))
    fetched = fetch_dataset(data_spec(tmp_path, dataset="dapo17k"))
    assert fetched.rows == {"train": 27, "test": 3}
    train, test = (pq.read_table(files[0]).to_pylist() for files in (fetched.train_files, fetched.val_files))
    trained = {row["prompt"][-1]["content"] for row in train}
    assert not [row for row in test if row["prompt"][-1]["content"] in trained]
    assert [row["extra_info"]["split"] for row in test] == ["test"] * 3 and [r["extra_info"]["index"] for r in test] == [0, 1, 2]


def test_a_local_dataset_by_column_mapping_with_a_template_and_a_system_prompt(tmp_path):
    source = tmp_path / "qa"
    source.mkdir()
    table = pa.Table.from_pylist([{"question": f"What is {n}+1?", "final": str(n + 1), "topic": "sums"} for n in range(20)])
    (source / "train.parquet").write_bytes(parquet_bytes(table))
    columns = {"prompt": "question", "answer": "final", "system_prompt": "You are terse.",
               "template": "{prompt} Answer in \\\\boxed{}.", "data_source": "HuggingFaceH4/MATH-500"}
    fetched = fetch_dataset(data_spec(tmp_path, dataset="mapped", source=str(source), columns=columns))
    assert fetched.rows == {"train": 18, "test": 2}  # no test file: a tenth held out
    row = pq.read_table(fetched.train_files[0]).to_pylist()[0]
    assert row["prompt"] == [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "What is 0+1? Answer in \\\\boxed{}."}]
    assert row["reward_model"]["ground_truth"] == "1" and row["extra_info"]["topic"] == "sums"


def test_chat_messages_columns_and_a_mapping_that_cannot_work(tmp_path):
    source = tmp_path / "chat"
    source.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{n}"}], "answer": str(n)} for n in range(10)]
    rows[3]["answer"] = ""
    rows[7]["messages"] = []
    (source / "train.parquet").write_bytes(parquet_bytes(pa.Table.from_pylist(rows)))
    (source / "test.parquet").write_bytes(parquet_bytes(pa.Table.from_pylist(rows[:2])))
    with pytest.raises(UserError, match=r"2 of 10 train rows have an empty prompt or answer \(rows 3, 7\)"):
        fetch_dataset(data_spec(tmp_path, dataset="mapped", source=str(source), columns={"messages": "messages"}))
    with pytest.raises(UserError, match="has no column 'question'"):
        fetch_dataset(data_spec(tmp_path, dataset="mapped", source=str(source), columns={"prompt": "question"}))
    with pytest.raises(UserError, match="is a list, not text"):
        fetch_dataset(data_spec(tmp_path, dataset="mapped", source=str(source), columns={"prompt": "messages"}))


def test_a_mapping_that_names_neither_or_both_prompt_columns_is_refused_at_planning(cli):
    planned = ("--model", "tiny", "--device", "cpu", "--dry-run", "--json", "--set", "data.dataset=mapped", "--set",
               "data.source=x/y")
    result = cli(*planned, "--set", "data.columns.prompt=q", "--set", "data.columns.messages=m")
    assert result.returncode == 2 and "set exactly one of data.columns.prompt" in result.stderr
    assert DataColumns(prompt="q").answer == "answer"
    assert json.loads(cli(*planned, "--set", "data.columns.prompt=q").stdout)["profile"]["data"]["columns"]["prompt"] == "q"
