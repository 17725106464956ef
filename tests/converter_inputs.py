"""What the converter's tests feed it: tiny real models and checkpoints, damaged on purpose, and a
conversion stopped mid-way (tests/e2e/test_converter_bad_input.py, tests/e2e/test_converter_output.py).

    .venv/bin/python -m pytest -q tests/e2e/test_converter_bad_input.py tests/e2e/test_converter_output.py
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_pipeline.checkpoints.megatron_layout import hf_to_dist

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # a run takes seconds, a minute on a loaded 2-core machine: this only stops a hang


@dataclass
class Sources:
    llama: Path  # a 3-layer Llama (hidden 64, 8 heads, 2 KV heads, head_dim 8), random weights
    dist: Path  # its dist checkpoint
    tiny: Path  # the `tiny` model: a 2-layer Qwen3 (head_dim 16, q/k norms)
    tiny_dist: Path


def make_sources(root: Path, tiny_model_dir: Path) -> Sources:
    source = llama(root / "llama")
    return Sources(source, hf_to_dist(source, root / "llama-dist"), tiny_model_dir,
                   hf_to_dist(tiny_model_dir, root / "tiny-dist"))


def llama(to: Path, vocab: int = 300) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=False)).save_pretrained(to)
    return to


def copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def with_config(source: Path, to: Path, **changes) -> Path:
    """A copy of `source` whose config.json has `changes` (None: the key removed)."""
    config = json.loads((copy(source, to) / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (to / "config.json").write_text(json.dumps(config))
    return to


def with_tensors(source: Path, to: Path, change: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy(source, to) / "model.safetensors")
    change(tensors)
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def with_bytes(source: Path, to: Path, name: str, change: Callable[[bytes], bytes]) -> Path:
    file = copy(source, to) / name
    file.write_bytes(change(file.read_bytes()))
    return to


def without(source: Path, to: Path, name: str) -> Path:
    (copy(source, to) / name).unlink()
    return to


def with_metadata(dist: Path, to: Path, change: Callable) -> Path:
    with open(copy(dist, to) / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # this converter's own file, made by the fixture: trusted
    change(metadata)
    with open(to / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return to


class RunsCode:
    """What a crafted `.metadata` holds: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "grpo_pipeline.checkpoints.convert", *argv]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# A conversion that stops itself (SIGSTOP) once its first tensor is written: mid-way, for as long
# as the test wants, with a real partial on disk.
STOPS_MID_WAY = """
import os, signal, sys
from grpo_pipeline.checkpoints import dist_writer
add_chunk = dist_writer.DistCheckpointWriter.add_chunk
def add_then_stop(writer, *args):
    add_chunk(writer, *args)
    if len(writer.storage) == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
dist_writer.DistCheckpointWriter.add_chunk = add_then_stop
from grpo_pipeline.checkpoints.convert import main
raise SystemExit(main(sys.argv[1:]))
"""


@contextlib.contextmanager
def stopped_mid_way(argv: list[str]) -> Iterator[subprocess.Popen]:
    """The conversion of `argv`, stopped; killed at the end if the test left it running."""
    process = subprocess.Popen([sys.executable, "-c", STOPS_MID_WAY, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        _, status = os.waitpid(process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"the conversion ended before its first tensor (status {status})"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
