"""Download throughput of the base-model stage vs plain `snapshot_download`, side by side.

    .venv/bin/python bench/bench_download.py [--mb 400] [--rounds 3] [--link-mbs 200]

A local Hub-compatible server on 127.0.0.1 (tests/hub_server.py) serves a Qwen3-shaped model with
sharded safetensors. Each round downloads it twice into fresh directories, alternating the order:
once with `huggingface_hub.snapshot_download` alone (what `hf download` does), once through
`prepare_model` (revision resolved once, names checked, every file checked against the hub's
sha256, manifest, atomic rename, config + safetensors + shape check). It prints MB/s for both and
the ratio stage / plain (1.0 = the checks cost nothing), then the time of a cached second run.
Unlimited loopback makes the transfer CPU-bound, so hashing competes with it for the 2 cores;
`--link-mbs` limits the server like a network link, where hashing overlaps the transfer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from huggingface_hub import snapshot_download  # noqa: E402

from hub_server import HubServer  # noqa: E402
from grpo_pipeline.profiles.schema import ModelArchitecture, ModelSection  # noqa: E402
from grpo_pipeline.stages.model import ModelSpec, prepare_model  # noqa: E402


def make_model(out: Path, megabytes: int) -> ModelArchitecture:
    """A Qwen3-shaped checkpoint of about `megabytes` MB in 100 MB shards (uninitialised weights:
    the bytes do not matter here, only their number)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers = 1024, max(1, round((megabytes * 2**20 / 4 - 16384 * 1024) / 12.6e6))
    config = Qwen3Config(vocab_size=16384, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to_empty(device="cpu")
    model.save_pretrained(out, max_shard_size="100MB")
    return ModelArchitecture(num_layers=layers, num_attention_heads=16, num_kv_heads=8, hidden_size=hidden, vocab_size=16384)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="checkpoint size in MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--link-mbs", type=float, default=None,
                        help="limit the server to this many MB/s (a network link); default: loopback speed")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-download-"))
    try:
        arch = make_model(work / "source", args.mb)
        files = {p.name: p.read_bytes() for p in (work / "source").iterdir()}
        total_mb = sum(len(b) for b in files.values()) / 2**20
        print(f"model: {len(files)} files, {total_mb:.0f} MB; {args.rounds} rounds, order alternating")
        plain_s, stage_s = [], []
        with HubServer() as hub:
            os.environ["HF_ENDPOINT"] = hub.url
            os.environ["HF_HOME"] = str(work / "hf-home")
            hub.add_repo("bench/model", files, repo_type="model")
            if args.link_mbs:
                hub.bandwidth = args.link_mbs * 2**20
                print(f"link limited to {args.link_mbs:.0f} MB/s")

            def plain(i: int) -> float:
                start = time.perf_counter()
                snapshot_download("bench/model", repo_type="model", local_dir=work / f"plain-{i}", endpoint=hub.url)
                return time.perf_counter() - start

            def stage(i: int) -> float:
                spec = ModelSpec.from_profile(ModelSection(path="bench/model", root=str(work / f"store-{i}"), architecture=arch))
                start = time.perf_counter()
                checkpoint = prepare_model(spec, arch, log=lambda m: None)
                elapsed = time.perf_counter() - start
                assert not checkpoint.cached
                return elapsed

            for i in range(args.rounds):
                order = (plain, stage) if i % 2 == 0 else (stage, plain)
                for run in order:
                    (plain_s if run is plain else stage_s).append(run(i))
                shutil.rmtree(work / f"plain-{i}")
            spec = ModelSpec.from_profile(ModelSection(path="bench/model", root=str(work / "store-0"), architecture=arch))
            hub.reset_requests()
            start = time.perf_counter()
            assert prepare_model(spec, arch).cached
            cached_s = time.perf_counter() - start
            cached_requests = len(hub.requests)
        plain_med, stage_med = statistics.median(plain_s), statistics.median(stage_s)
        print(f"plain snapshot_download: {' '.join(f'{s:.2f}s' for s in plain_s)}  median {total_mb / plain_med:.0f} MB/s")
        print(f"prepare_model (stage):   {' '.join(f'{s:.2f}s' for s in stage_s)}  median {total_mb / stage_med:.0f} MB/s")
        print(f"throughput ratio stage / plain: {plain_med / stage_med:.2f}")
        print(f"cached second run: {cached_s * 1000:.0f} ms, {cached_requests} HTTP requests")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
