"""What trusting a cached store entry costs: the check a cache hit runs vs hashing every byte.

    .venv/bin/python bench/bench_cache_check.py [--mb 500] [--rounds 5]

Before the data and model stages reuse an earlier run's result, the flow checks the store entry
it names (`verify_entry`): every file of an entry up to 256 MB is hashed (sha256); above that, each
file's size, mtime and ctime are compared with the manifest and only a file whose times changed is
hashed. This builds three entries in a fresh store (the `arith` dataset, the `tiny` model, and a
synthetic entry of `--mb` MB in 100 MB files, like shards of a checkpoint) and times, side by side
in each round, the cache-hit check (`verify_entry(entry)`), the full hash
(`verify_entry(entry, deep=True)`, also `python -m grpo_pipeline.store.content ENTRY --deep`) and the size-only look
the cache used before (`deep=False`, which missed a flipped byte). Medians, in ms; files are in the
page cache after the first round, so the full hash measures sha256, not the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_pipeline.stages.plan import resolve_profile  # noqa: E402
from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset  # noqa: E402
from grpo_pipeline.stages.model import ModelSpec, prepare_model  # noqa: E402
from grpo_pipeline.store.content import Built, Store, verify_entry, what_is_checked  # noqa: E402

SHARD_MB = 100


def synthetic_entry(root: Path, megabytes: int) -> Path:
    def build(scratch: Path, out: Path) -> Built:
        left, index = megabytes, 0
        while left > 0:
            size = min(SHARD_MB, left)
            (out / f"model-{index:05d}.safetensors").write_bytes(os.urandom(size << 20))
            left, index = left - size, index + 1
        return Built()

    return Store(root).get_or_build("synthetic", {"megabytes": megabytes}, build, log=lambda message: None).path


def timed_ms(check) -> float:
    started = time.perf_counter()
    problems = check()
    elapsed = (time.perf_counter() - started) * 1000
    assert problems == [], problems
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500, help="size of the synthetic entry (default 500)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cache-check-"))
    profile = resolve_profile("tiny", "cpu", overrides=[f"data.root={root / 'data'}", f"model.root={root / 'models'}"])
    entries = {
        "arith dataset": Path(fetch_dataset(DataSpec.from_profile(profile.data), log=lambda message: None).path),
        "tiny model": Path(prepare_model(ModelSpec.from_profile(profile.model), log=lambda message: None).path),
        f"{args.mb} MB entry": synthetic_entry(root / "synthetic", args.mb),
    }
    checks = {"cache hit": lambda p: verify_entry(p), "full sha256": lambda p: verify_entry(p, deep=True),
              "sizes only (before)": lambda p: verify_entry(p, deep=False)}
    times = {(entry, check): [] for entry in entries for check in checks}
    for round_ in range(args.rounds):
        for entry, path in entries.items():
            order = list(checks) if round_ % 2 == 0 else list(reversed(checks))  # alternate who goes first
            for check in order:
                times[entry, check].append(timed_ms(lambda: checks[check](path)))
    print(f"{'entry':<16} {'what a cache hit checks':<72} " + " ".join(f"{c:>20}" for c in checks) + "  hit / full")
    for entry, path in entries.items():
        medians = {check: statistics.median(times[entry, check]) for check in checks}
        cells = " ".join(f"{medians[c]:>17.1f} ms" for c in checks)
        print(f"{entry:<16} {what_is_checked(path):<72} {cells}  {medians['cache hit'] / medians['full sha256']:>9.3f}")


if __name__ == "__main__":
    main()
