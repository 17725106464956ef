"""The `fetch_dataset` stage: training and validation parquet files in verl's RL schema, fetched once.

    python -m grpo_pipeline --model tiny --stages fetch_dataset                      # arith, no network
    python -m grpo_pipeline --model tiny --set data.dataset=gsm8k --stages fetch_dataset
    HF_ENDPOINT=https://hf-mirror.com python -m grpo_pipeline --set data.dataset=geo3k \\
        --set data.source=tyzhu/geo3k --stages fetch_dataset

The result is a content-store entry (`store/content.py`) under `data.root`, keyed by source, revision,
file patterns and converter version: the second run with the same inputs reads only the manifest
and hashes the files (no network), and a damaged entry is built again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.yaml_files import path_kind
from grpo_pipeline.profiles.schema import DataSection
from grpo_pipeline.store.content import Built, Store
from grpo_pipeline.profiles.evaluation import HELDOUT
from grpo_pipeline.profiles.datasets import EVALUATION_ONLY, SOURCES, DataColumns, DatasetName, data_source_of

if TYPE_CHECKING:
    import pyarrow as pa

    from grpo_pipeline.profiles.schema import RunProfile

# pyarrow and huggingface_hub are imported where files are made, so planning a run (a dry run
# renders paths of this stage) stays fast.
ARITH = "arith"
# Bumped whenever a converter's output (data/rl_data.py) changes, so cached datasets are rebuilt.
CONVERTER_VERSION = 2

SPLITS = ("train", "test")
# Where each dataset comes from when `data.source` is empty, and which files of it are wanted.
DEFAULT_SOURCES = {name: repo for name, (repo, _) in SOURCES.items()}
DEFAULT_FILES = {repo: files for repo, files in SOURCES.values()}
ANY_PARQUET = ["*.parquet", "*.jsonl"]
# The validation split is the test split where there is one, as in verl's examples.
_SPLIT_OF_FILE = re.compile(r"(?:^|[/_-])(train|test|validation|valid|val|dev)(?:[-_.]|$)")
# A source's file with no split in its name (DAPO-Math-17k's one file) is its training split.
_DATA_FILES = (".parquet", ".jsonl")
_SPLIT_NAMES = {"train": "train", "test": "test", "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation"}


class DataSpec(BaseModel):
    """What data a run asks for (the dataset part of the profile)."""

    dataset: DatasetName
    source_kind: Literal["builtin", "hub", "local"]
    source: str = Field(..., description="Repo id, local directory, or `arith`.")
    revision: str = Field("main", description="Hub revision; unused for local and built-in data.")
    files: list[str] = Field(default_factory=list, description="File patterns within the source.")
    root: Path = Field(..., description="Store root (shared by all nodes on a cluster).")
    seed: int = 0
    arith_rows: dict[str, int] = Field(default_factory=dict)
    columns: DataColumns | None = Field(None, description="`mapped`: the columns that make the rows.")
    data_source: str = Field("", description="The data_source the converted rows carry.")

    @classmethod
    def from_profile(cls, data: DataSection) -> DataSpec:
        root = Path(data.root).expanduser().resolve()
        if data.dataset == ARITH and data.source in (None, "", ARITH):
            return cls(
                dataset=ARITH, source_kind="builtin", source=ARITH, root=root, seed=data.seed,
                arith_rows={"train": data.arith_train_rows, "test": data.arith_test_rows},
            )
        if data.dataset == ARITH:
            raise UserError(f"data.source={data.source!r}: arith data is generated; leave data.source empty")
        if data.dataset == "mapped" and not data.source:
            raise UserError("data.dataset=mapped: set data.source to a hub dataset repo id or a local directory")
        source = data.source or DEFAULT_SOURCES[data.dataset]
        local = Path(source).expanduser()
        is_dir = path_kind(local, "data.source") == "dir"
        kind = "local" if source.startswith(("/", ".", "~")) or is_dir else "hub"
        if kind == "local" and not is_dir:
            raise UserError(f"data.source={source!r} is not a directory; give a local directory or a hub repo id")
        files = data.files or DEFAULT_FILES.get(source, ANY_PARQUET)
        return cls(
            dataset=data.dataset, source_kind=kind, source=str(local.resolve()) if kind == "local" else source,
            revision=data.revision, files=files, root=root, data_source=data_source_of(data),
            columns=data.columns if data.dataset == "mapped" else None,
        )

    def identity(self) -> dict[str, Any]:
        """What the content depends on; the store key hashes it."""
        identity: dict[str, Any] = {"dataset": self.dataset, "source": self.source, "version": CONVERTER_VERSION}
        if self.columns is not None:
            identity |= {"columns": self.columns.model_dump(), "data_source": self.data_source}
        if self.source_kind == "builtin":
            identity |= {"seed": self.seed, "rows": self.arith_rows}
        elif self.source_kind == "hub":
            identity |= {"revision": self.revision, "files": self.files}
        else:
            # A local directory is keyed by what is in it now, so an edited file is converted again.
            identity |= {"files": {p.relative_to(self.source).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns]
                                   for p in _matching_files(Path(self.source), self.files)}}
        return identity

    @property
    def store_name(self) -> str:
        return self.dataset


class DatasetFiles(BaseModel):
    dataset: str
    source: str
    revision: str | None = Field(None, description="Revision asked for (hub sources).")
    commit: str | None = Field(None, description="Commit the revision resolved to (hub sources).")
    path: str = Field(..., description="Directory of the verified files and their manifest.")
    train_files: list[str]
    val_files: list[str]
    rows: dict[str, int] = Field(..., description="Rows per split.")
    sha256: dict[str, str] = Field(..., description="sha256 of every file, from the manifest.")
    cached: bool = Field(..., description="True when nothing was fetched or built.")


def dataset_problems(d: DataSection) -> list[str]:
    """Splits the arith generator cannot make, refused at planning (found minutes in, at this stage, otherwise)."""
    if d.dataset != "arith" or d.source:
        return []
    from grpo_pipeline.data.rl_data import arith_rows_problem  # pyarrow: only for arith runs

    problem = arith_rows_problem(d.arith_train_rows, d.arith_test_rows, d.seed)
    return [problem] if problem else []


def benchmark_specs(profile: RunProfile) -> dict[str, DataSpec]:
    """The data of each benchmark of `eval.benchmarks` but `heldout` (the run's own validation split): a
    built-in dataset from its default source, into the run's `data.root` (arith: the run's generator settings)."""
    d = profile.data
    return {name: DataSpec.from_profile(DataSection(dataset=name, root=d.root, seed=d.seed, arith_train_rows=d.arith_train_rows,
                                                    arith_test_rows=d.arith_test_rows))
            for name in profile.eval.benchmarks if name != HELDOUT}


def dataset_dir(spec: DataSpec) -> Path:
    """Where the dataset's entry lives, known without fetching it (for a dry run's command)."""
    return Store(spec.root).path_for(spec.store_name, spec.identity())


def fetch_dataset(spec: DataSpec, log=print) -> DatasetFiles:
    entry = Store(spec.root).get_or_build(spec.store_name, spec.identity(), lambda scratch, out: _build(spec, scratch, out), log)
    details = entry.manifest.details
    return DatasetFiles(
        dataset=spec.dataset,
        source=spec.source,
        revision=spec.revision if spec.source_kind == "hub" else None,
        commit=details.get("commit"),
        path=str(entry.path),
        train_files=[str(entry.path / "train.parquet")],
        val_files=[str(entry.path / "test.parquet")],
        rows=details["rows"],
        sha256={name: record.sha256 for name, record in entry.manifest.files.items()},
        cached=entry.cached,
    )


def _build(spec: DataSpec, scratch: Path, out: Path) -> Built:
    import pyarrow.parquet as pq

    from grpo_pipeline.store.hub import fetch_snapshot
    from grpo_pipeline.data.rl_data import arith_splits, check_rl_file

    details: dict[str, Any] = {}
    if spec.source_kind == "builtin":
        tables = arith_splits(spec.arith_rows["train"], spec.arith_rows["test"], spec.seed)
    else:
        if spec.source_kind == "hub":
            snapshot = fetch_snapshot(spec.source, "dataset", spec.revision, spec.files, scratch / "download")
            details |= {"commit": snapshot.commit, "source_files": snapshot.files}
            source_dir = scratch / "download"
        else:
            source_dir = Path(spec.source)
        tables = _convert(spec, _read_splits(source_dir, spec.files, spec.source))
    for split, table in tables.items():
        pq.write_table(table, out / f"{split}.parquet")
    details["rows"] = {split: check_rl_file(out / f"{split}.parquet") for split in SPLITS}
    return Built(details=details)


def _matching_files(directory: Path, patterns: list[str]) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*") if p.suffix in _DATA_FILES and p.is_file()
        if not any(part.startswith(".") for part in p.relative_to(directory).parts)
        and any(p.relative_to(directory).match(pattern) for pattern in patterns)
    )


def _read_splits(directory: Path, patterns: list[str], source: str) -> dict[str, pa.Table]:
    """The source's files grouped by split (file name), shards concatenated."""
    import pyarrow as pa

    from grpo_pipeline.data.rl_data import DatasetFormatError

    shards: dict[str, list[Path]] = {}
    for path in _matching_files(directory, patterns):
        found = _SPLIT_OF_FILE.search(path.relative_to(directory).as_posix())
        shards.setdefault(_SPLIT_NAMES[found.group(1)] if found else "train", []).append(path)
    if "test" not in shards and "validation" in shards:
        shards["test"] = shards.pop("validation")
    if not {"train", "test"} & set(shards):
        raise DatasetFormatError(
            f"{source}: no data file among the files matching {patterns}; name files train*.parquet and "
            "test*.parquet (or .jsonl), or set data.files"
        )
    try:
        return {split: pa.concat_tables([_read_table(p) for p in shards[split]], promote_options="default")
                for split in SPLITS if split in shards}
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetFormatError(f"{source}: unreadable data file ({exc})") from exc


def _read_table(path: Path) -> pa.Table:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    return pj.read_json(path) if path.suffix == ".jsonl" else pq.read_table(path)


def _convert(spec: DataSpec, raw: dict[str, pa.Table]) -> dict[str, pa.Table]:
    from grpo_pipeline.data.mapped_data import convert_mapped
    from grpo_pipeline.data.math_data import CONVERTERS, complete_splits, hold_out
    from grpo_pipeline.data.rl_data import DatasetFormatError, convert_geo3k, convert_gsm8k, is_rl_table, rl_schema_problems

    converters = {"gsm8k": convert_gsm8k, "geo3k": convert_geo3k,
                  "mapped": lambda table, split: convert_mapped(table, split, spec.columns, spec.data_source),
                  **CONVERTERS}
    def convert(table: pa.Table, split: str) -> pa.Table:
        if is_rl_table(table) and spec.dataset != "dapo17k":
            problems = rl_schema_problems(table)
            if problems:
                raise DatasetFormatError(f"{spec.source} {split}: not in verl's RL schema: {'; '.join(problems)}")
            return table
        return converters[spec.dataset](table, split)

    splits = complete_splits(raw, spec.dataset in EVALUATION_ONLY, spec.source)
    if splits is None:  # one training split: its test split is held out by prompt once converted
        return hold_out(convert(next(iter(raw.values())), "train"), spec.source)
    return {split: convert(table, split) for split, table in splits.items()}
