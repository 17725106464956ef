"""verl RL parquet files: the arith generator, the gsm8k and geo3k converters, the schema check, and
verl's own RLHFDataset reading what the stage writes."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets_fixtures import geo3k_table, gsm8k_table, parquet_bytes
from grpo_pipeline.profiles.schema import DataSection
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
from grpo_pipeline.data.rl_data import (
    ARITH_SOURCE,
    DatasetFormatError,
    arith_splits,
    convert_geo3k,
    convert_gsm8k,
    gsm8k_ground_truth,
    rl_schema_problems,
)


def test_arith_is_deterministic_exact_and_held_out():
    first, again = arith_splits(200, 40, seed=3), arith_splits(200, 40, seed=3)
    assert first["train"].equals(again["train"]) and first["test"].equals(again["test"])
    assert not arith_splits(200, 40, seed=4)["train"].equals(first["train"])
    rows = first["train"].to_pylist()
    assert len(rows) == 200 and all(r["data_source"] == ARITH_SOURCE for r in rows)
    for row in rows:
        question, truth = row["extra_info"]["question"], row["reward_model"]["ground_truth"]
        numbers = [int(t) for t in question.replace("?", " ").split() if t.isdigit()]
        op = "+" if ("+" in question or "buys" in question) else "-" if ("-" in question or "taken" in question) else "*"
        expected = numbers[0] + numbers[1] if op == "+" else numbers[0] - numbers[1] if op == "-" else numbers[0] * numbers[1]
        assert int(truth) == expected, question
    train_questions = {r["extra_info"]["question"] for r in rows}
    test_questions = {r["extra_info"]["question"] for r in first["test"].to_pylist()}
    assert len(train_questions) == 200 and not train_questions & test_questions
    assert rl_schema_problems(first["train"]) == []


def test_gsm8k_conversion_matches_the_reference_prompt_and_answer():
    table = convert_gsm8k(gsm8k_table(3), "train")
    row = table.to_pylist()[2]
    assert row["data_source"] == "openai/gsm8k"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"]
                              + ' Let\'s think step by step and output the final answer after "####".'}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "6000"}  # "6,000" without the comma
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 2
    assert gsm8k_ground_truth("so\n#### -1,234.5") == "-1234.5"
    with pytest.raises(DatasetFormatError, match="####"):
        gsm8k_ground_truth("no marker here")
    with pytest.raises(DatasetFormatError, match="missing column.*question"):
        convert_gsm8k(pa.table({"text": ["x"]}), "train")


def test_geo3k_conversion_keeps_images_paired_with_placeholders():
    table = convert_geo3k(geo3k_table(2), "test")
    row = table.to_pylist()[1]
    assert row["data_source"] == "hiyouga/geometry3k" and row["reward_model"]["ground_truth"] == "59"
    assert row["prompt"][0]["content"].startswith("<image>Find x.") and "\\boxed{}" in row["prompt"][0]["content"]
    assert len(row["images"]) == 1 and row["images"][0]["bytes"].startswith(b"\x89PNG")
    no_placeholder = geo3k_table(1).set_column(1, "problem", pa.array(["Find y."]))
    assert convert_geo3k(no_placeholder, "train").to_pylist()[0]["prompt"][0]["content"].startswith("<image>Find y.")
    assert rl_schema_problems(table) == []


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda t: t.drop_columns(["reward_model"]), "column 'reward_model' is missing"),
        (lambda t: t.slice(0, 0), "no rows"),
        (lambda t: t.set_column(3, "reward_model", pa.array([{"style": "rule", "ground_truth": ""}] * t.num_rows)),
         "ground_truth is empty"),
        (lambda t: t.set_column(1, "prompt", pa.array([[]] * t.num_rows, t.schema.field("prompt").type)),
         "non-empty list of {role, content}"),
    ],
)
def test_schema_check_names_the_problem(mutate, problem):
    table = arith_splits(4, 2, seed=0)["train"]
    assert any(problem in p for p in rl_schema_problems(mutate(table)))


def test_image_placeholder_count_must_match_the_images():
    table = convert_geo3k(geo3k_table(1), "train")
    doubled = table.set_column(
        table.schema.get_field_index("prompt"), "prompt",
        pa.array([[{"role": "user", "content": "<image><image>Find x."}]], table.schema.field("prompt").type),
    )
    assert any("2 <image> placeholder(s) for 1 image(s)" in p for p in rl_schema_problems(doubled))


def test_local_directories_in_either_layout(tmp_path):
    raw = tmp_path / "gsm8k-raw"
    (raw / "main").mkdir(parents=True)
    (raw / "main" / "train-00000-of-00001.parquet").write_bytes(parquet_bytes(gsm8k_table(5)))
    (raw / "main" / "test-00000-of-00001.parquet").write_bytes(parquet_bytes(gsm8k_table(2)))
    files = fetch_dataset(DataSpec.from_profile(DataSection(dataset="gsm8k", source=str(raw), root=str(tmp_path / "store"))))
    assert files.rows == {"train": 5, "test": 2} and not files.cached
    # The tyzhu/geo3k layout: train.parquet / test.parquet already in verl's schema, used as they are.
    ready = tmp_path / "geo3k-ready"
    ready.mkdir()
    for split, rows in (("train", 3), ("test", 2)):
        pq.write_table(convert_geo3k(geo3k_table(rows), split), ready / f"{split}.parquet")
    files = fetch_dataset(DataSpec.from_profile(DataSection(dataset="geo3k", source=str(ready), root=str(tmp_path / "store"))))
    assert files.rows == {"train": 3, "test": 2}
    assert pq.read_table(files.train_files[0]).equals(pq.read_table(ready / "train.parquet"))
    # Editing a local file changes the key: the next run converts again instead of serving stale data.
    pq.write_table(convert_geo3k(geo3k_table(4), "train"), ready / "train.parquet")
    again = fetch_dataset(DataSpec.from_profile(DataSection(dataset="geo3k", source=str(ready), root=str(tmp_path / "store"))))
    assert again.rows["train"] == 4 and again.path != files.path


def test_a_local_directory_without_splits_or_schema_is_refused(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "everything.parquet").write_bytes(parquet_bytes(gsm8k_table(2)))
    spec = DataSpec.from_profile(DataSection(dataset="gsm8k", source=str(bad), root=str(tmp_path / "store")))
    with pytest.raises(DatasetFormatError, match="2 distinct prompts and no test split; give a test"):
        fetch_dataset(spec)
    assert not (tmp_path / "store" / "gsm8k").exists()


# --- verl's own loader ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_dataset_class():
    # verl is installed with --no-deps; the dev extra brings the loader's own imports (tensordict...).
    from verl.utils.dataset.rl_dataset import RLHFDataset

    return RLHFDataset


def _verl_config(tmp_path, **extra):
    from omegaconf import OmegaConf

    return OmegaConf.create({"cache_dir": str(tmp_path / "verl-cache"), "max_prompt_length": 128,
                             "filter_overlong_prompts": True, "filter_overlong_prompts_workers": 1, **extra})


@pytest.mark.e2e  # verl's dataset forks worker processes
def test_verl_rlhf_dataset_reads_arith_and_gsm8k(tmp_path, verl_dataset_class):
    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(512, seed=0)
    arith = fetch_dataset(DataSpec.from_profile(DataSection(root=str(tmp_path), arith_train_rows=16, arith_test_rows=4)))
    gsm8k_dir = tmp_path / "gsm8k"
    gsm8k_dir.mkdir()
    pq.write_table(convert_gsm8k(gsm8k_table(6), "train"), gsm8k_dir / "train.parquet")
    for path, rows in ((arith.train_files[0], 16), (str(gsm8k_dir / "train.parquet"), 6)):
        dataset = verl_dataset_class(path, tokenizer, _verl_config(tmp_path, max_prompt_length=512))
        assert len(dataset) == rows
        item = dataset[0]
        assert item["raw_prompt"][0]["role"] == "user"
        assert item["reward_model"]["ground_truth"] and item["data_source"]
        assert item["index"] == 0


def test_verl_rlhf_dataset_builds_image_messages_for_geo3k(tmp_path, verl_dataset_class):
    from grpo_pipeline.data.builtin_models import train_tiny_tokenizer

    path = tmp_path / "geo3k-train.parquet"
    pq.write_table(convert_geo3k(geo3k_table(2), "train"), path)
    dataset = verl_dataset_class(str(path), train_tiny_tokenizer(512, seed=0), _verl_config(tmp_path, filter_overlong_prompts=False))
    # verl only asks that a processor exists before it pairs <image> placeholders with the images.
    dataset.processor = object()
    content = dataset[1]["raw_prompt"][0]["content"]
    assert [part["type"] for part in content] == ["image", "text"]
    assert content[0]["image"].size == (9, 9)  # the PNG decoded from the stored bytes
