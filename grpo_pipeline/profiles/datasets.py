"""The datasets a profile can name, the data_source each one's rows carry, and the column mapping that
brings any other hub or local dataset.

    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=math500 --stages fetch_dataset
    python -m grpo_pipeline --model tiny --device cpu --set data.dataset=mapped --set data.source=/data/my-qa \\
        --set data.columns.prompt=question --set data.columns.answer=final --stages fetch_dataset

Where each built-in comes from and how it is converted is data/math_data.py's (and data/rl_data.py's
for arith, gsm8k and geo3k); the data_source picks the built-in reward (rewards/builtin.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.profiles.section import Section

DatasetName = Literal["arith", "gsm8k", "geo3k", "math", "math500", "dapo17k", "aime24", "aime25", "mapped"]
# verl's names where verl's own preprocessing scripts give one (examples/data_preprocess/*.py, reward_score/__init__.py).
DATA_SOURCES = {
    "arith": "arith", "gsm8k": "openai/gsm8k", "geo3k": "hiyouga/geometry3k",
    "math": "DigitalLearningGmbH/MATH-lighteval", "math500": "HuggingFaceH4/MATH-500", "dapo17k": "math_dapo",
    "aime24": "aime24", "aime25": "aime25",
}

# Where each built-in comes from (a hub dataset repo) and which of its files, as published there
# (data/math_data.py's table says more); arith is generated.
SOURCES = {
    "gsm8k": ("openai/gsm8k", ["main/*.parquet"]),
    "geo3k": ("hiyouga/geometry3k", ["data/*.parquet"]),
    "math": ("DigitalLearningGmbH/MATH-lighteval", ["data/*.parquet"]),
    "math500": ("HuggingFaceH4/MATH-500", ["test.jsonl"]),
    "dapo17k": ("BytedTsinghua-SIA/DAPO-Math-17k", ["data/*.parquet"]),
    "aime24": ("HuggingFaceH4/aime_2024", ["data/*.parquet"]),
    "aime25": ("yentinglin/aime_2025", ["data/*.parquet"]),
}
# Benchmarks of one split: it is both the training and the test split.
EVALUATION_ONLY = ("math500", "aime24", "aime25")


class DataColumns(Section):
    """`data.dataset=mapped`: which columns of the source make verl's RL rows."""

    prompt: str | None = Field(None, description="Column of the question as text (or `messages`).")
    messages: str | None = Field(None, description="Column of the prompt as chat messages (a list of {role, "
                                 "content}), instead of `prompt`.")
    answer: str = Field("answer", description="Column of the ground truth the reward compares with.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")
    template: str | None = Field(None, description="The user message, with `{prompt}` where the question goes (e.g. "
                                 "`{prompt} Put the final answer in \\\\boxed{}.`); empty: the question as it is.")
    data_source: str | None = Field(
        None, description="The rows' data_source, which picks the built-in reward (e.g. `HuggingFaceH4/MATH-500` for "
        "math-verify's grading); empty: `data.source` (then bring a reward: reward.functions or reward.url).")


def data_source_of(data) -> str:
    """The data_source the rows of `data` (the profile's DataSection) carry."""
    if data.dataset == "mapped":
        return data.columns.data_source or str(data.source)
    return DATA_SOURCES[data.dataset]


def mapping_problems(data) -> list[str]:
    """What a mapped dataset's settings lack, before anything is fetched."""
    if data.dataset != "mapped":
        return []
    problems = []
    if not data.source:
        problems.append("data.dataset=mapped: set data.source to a hub dataset repo id or a local directory")
    if (data.columns.prompt is None) == (data.columns.messages is None):
        problems.append("data.dataset=mapped: set exactly one of data.columns.prompt (a text column) and "
                        "data.columns.messages (a chat messages column)")
    if data.columns.template is not None and "{prompt}" not in data.columns.template:
        problems.append(f"data.columns.template={data.columns.template!r}: put {{prompt}} where the question goes")
    return problems
