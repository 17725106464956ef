"""The converter's command line against hostile input (`python -m grpo_pipeline.checkpoints.convert`): each bad
input is exactly one `error:` line on stderr and exit 2, no traceback, and nothing left behind (no
OUT, no partial, no parent it made, a foreign OUT untouched); a crafted `.metadata` runs nothing.
Most cases call `main` in this process; a few run the command line as a subprocess, one of them
stopped mid-way while another process makes OUT.

    .venv/bin/python -m pytest -q tests/e2e/test_converter_bad_input.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from converter_inputs import (
    HANG_GUARD_S,
    ROOT,
    RunsCode,
    Sources,
    cli,
    copy,
    env,
    make_sources,
    stopped_mid_way,
    with_bytes,
    with_config,
    with_metadata,
    with_tensors,
    without,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from grpo_pipeline.checkpoints.convert import main

QKV = "decoder.layers.self_attention.linear_qkv.weight"


@dataclass
class Place:
    """Where a case builds its input (`tmp`), and what it must undo after (a mount)."""

    tmp: Path
    sources: Sources
    finalizers: list[Callable[[], None]] = field(default_factory=list)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model_dir) -> Sources:
    return make_sources(tmp_path_factory.mktemp("sources"), tiny_model_dir)


def crafted_metadata(place: Place) -> list[str]:
    dist = copy(place.sources.dist, place.tmp / "crafted")
    (dist / ".metadata").write_bytes(pickle.dumps(RunsCode(f"touch {place.tmp / 'code-ran'}")))
    return ["to-hf", str(dist), str(place.sources.llama), str(place.tmp / "out")]


def read_only_dir(place: Place) -> Path:
    """A directory this process cannot write in: a read-only tmpfs where mounting is allowed (root
    here; root ignores a directory's mode), else its write bits off (a non-root user), else /sys
    (root without mount rights: sysfs refuses mkdir)."""
    folder = place.tmp / "read-only"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)]
    if shutil.which("mount") and subprocess.run(mount, capture_output=True).returncode == 0:
        place.finalizers.append(lambda: subprocess.run(["umount", str(folder)], check=True))
        return folder
    if os.geteuid() != 0:
        folder.chmod(0o555)
        place.finalizers.append(lambda: folder.chmod(0o755))
        return folder
    folder.rmdir()
    return Path("/sys")


def to_dist(build: Callable[[Place], Path]) -> Callable[[Place], list[str]]:
    return lambda place: ["to-dist", str(build(place)), str(place.tmp / "out")]


def to_hf(build: Callable[[Place], Path], config: Callable[[Place], Path] = lambda p: p.sources.llama):
    return lambda place: ["to-hf", str(build(place)), str(config(place)), str(place.tmp / "out")]


def out_at(out: Callable[[Place], Path]) -> Callable[[Place], list[str]]:
    return lambda place: ["to-dist", str(place.sources.llama), str(out(place))]


def llama_source(place: Place) -> Path:
    return place.sources.llama


def tiny_source(place: Place) -> Path:
    return place.sources.tiny


def hf_config(source=llama_source, **changes):
    return to_dist(lambda p: with_config(source(p), p.tmp / "m", **changes))


def hf_bytes(name: str, change: Callable[[bytes], bytes]):
    return to_dist(lambda p: with_bytes(p.sources.llama, p.tmp / "m", name, change))


def hf_tensors(change: Callable[[dict], None], source=llama_source):
    return to_dist(lambda p: with_tensors(source(p), p.tmp / "m", change))


def dist_bytes(name: str, change: Callable[[bytes], bytes]):
    return to_hf(lambda p: with_bytes(p.sources.dist, p.tmp / "d", name, change))


def dist_metadata(change: Callable):
    return to_hf(lambda p: with_metadata(p.sources.dist, p.tmp / "d", change))


def tiny_dist_with_config(**changes):
    return to_hf(lambda p: p.sources.tiny_dist, lambda p: with_config(p.sources.tiny, p.tmp / "config", **changes))


def _index_naming_a_missing_shard(place: Place) -> Path:
    lost = copy(place.sources.llama, place.tmp / "m")
    (lost / "model.safetensors").rename(lost / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (lost / "model.safetensors.index.json").write_text(json.dumps(index))
    return lost


def _dangling(place: Place) -> Path:
    (place.tmp / "out").symlink_to(place.tmp / "nowhere")
    return place.tmp / "out"


def _file(place: Place) -> Path:
    (place.tmp / "a-file").write_text("")
    return place.tmp / "a-file" / "out"


def _made_by_another(out: Path) -> None:
    out.mkdir()
    (out / "theirs.txt").write_text("another process's output")


def _replaced(folder: Path, name: str, make: Callable[[Path], None]) -> Path:
    (folder / name).unlink()
    make(folder / name)
    return folder


def _config_replaced(place: Place, make: Callable[[Path], None]) -> Path:
    return _replaced(copy(place.sources.llama, place.tmp / "m"), "config.json", make)


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # nobody writes it: a reader that opens it waits forever


def _to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")  # read whole, it fills memory


def _metadata_bytes(data: bytes):
    return dist_bytes(".metadata", lambda _: data)


# Only admitted opcodes: an empty dict whose one key is a tuple 200,000 deep. Hashing the key as
# the dict is filled recursed in C until the stack ran out: the converter died of SIGSEGV.
DEEP_TUPLE_KEY = b"\x80\x04}" + b")" + b"\x85" * 200_000 + b"Ns."
# builtins.bytearray(2**32), 34 bytes: built, 4 GiB (any count up to memory) before any check.
BYTEARRAY_OF_4_GIB = b"\x80\x04\x8c\x08builtins\x8c\tbytearray\x93\x8a\x05\x00\x00\x00\x00\x01\x85R."
LONG_NAME = "model.layers.0.extra." + "x" * 5_000_000


def _drop_chunk(metadata) -> None:
    metadata.state_dict_metadata[QKV].chunks.pop(1)


def _overlap_chunks(metadata) -> None:
    chunks = metadata.state_dict_metadata[QKV].chunks
    chunks[1] = ChunkStorageMetadata(offsets=chunks[0].offsets, sizes=chunks[1].sizes)


def _point_chunk_elsewhere(metadata) -> None:
    norm = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    metadata.storage_data[MetadataIndex(norm, torch.Size([0, 0]))] = metadata.storage_data[
        MetadataIndex(QKV, torch.Size([0, 0, 0]))]


def _extra_tensor(metadata) -> None:
    metadata.state_dict_metadata["decoder.layers.mlp.extra.weight"] = metadata.state_dict_metadata[QKV]


@dataclass(frozen=True)
class BadInput:
    id: str
    argv: Callable[[Place], list[str]]
    says: str  # what the one error line names
    run: str = "main"  # "main": in this process; "cli": a subprocess; "cli-stopped": one stopped mid-way for `meanwhile`
    meanwhile: Callable[[Path], None] | None = None


BAD_INPUTS = [
    # the HF side (to-dist)
    BadInput("header-cut-short", hf_bytes("model.safetensors", lambda b: b[:40]), "runs past the file's 40 bytes"),
    BadInput("empty-file", hf_bytes("model.safetensors", lambda b: b""), "(0 bytes, shorter than its 8-byte header length)"),
    BadInput("4-byte-file", hf_bytes("model.safetensors", lambda b: b[:4]), "(4 bytes, shorter than its 8-byte header length)"),
    BadInput("header-length-2^63", hf_bytes("model.safetensors", lambda b: (2 ** 63).to_bytes(8, "little") + b[8:]),
             "its header length, 9223372036854775808 bytes, runs past", run="cli"),
    BadInput("header-not-json", hf_bytes("model.safetensors", lambda b: b[:8] + b"\xff" * 16 + b[24:]),
             "its header is not JSON"),
    BadInput("tensor-data-cut-short", hf_bytes("model.safetensors", lambda b: b[:-100]), "the file is cut short or damaged"),
    BadInput("norm-shape-differs-in-one-layer", hf_tensors(lambda t: t.update(
        {"model.layers.1.post_attention_layernorm.weight": torch.ones(65)})),
             "tensor model.layers.1.post_attention_layernorm.weight has shape [65], but its config.json makes it [64]"),
    BadInput("mixed-dtypes-in-one-fused-tensor", hf_tensors(lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"].bfloat16()})),
             "tensor model.layers.0.self_attn.k_proj.weight is torch.bfloat16, but model.layers.0.self_attn.q_proj.weight"),
    BadInput("q-norm-of-7-where-head-dim-is-16", hf_tensors(lambda t: t.update(
        {f"model.layers.{i}.self_attn.q_norm.weight": torch.ones(7) for i in range(2)}), tiny_source),
             "tensor model.layers.0.self_attn.q_norm.weight has shape [7], but its config.json makes it [16]"),
    BadInput("config-of-more-layers-than-the-weights", hf_config(num_hidden_layers=4),
             "tensor model.layers.3.input_layernorm.weight is not in the checkpoint"),
    BadInput("config-of-fewer-layers-than-the-weights", hf_config(num_hidden_layers=2),
             "holds tensor model.layers.2.input_layernorm.weight and 8 more, which its config.json has no place for"),
    BadInput("config-without-num_hidden_layers", hf_config(num_hidden_layers=None),
             "config.json: num_hidden_layers is missing; it must be a positive integer"),
    BadInput("config-not-json", hf_bytes("config.json", lambda b: b"{not json"), "config.json: cannot be read as JSON"),
    BadInput("config-json-a-fifo", to_dist(lambda p: _config_replaced(p, _fifo)),
             "config.json: cannot be read as JSON (it is a FIFO, not a regular file)", run="cli"),
    BadInput("config-json-a-link-to-dev-zero", to_dist(lambda p: _config_replaced(p, _to_dev_zero)),
             "config.json: cannot be read as JSON (it is a character device, not a regular file)", run="cli"),
    BadInput("config-json-nested-200000-deep", hf_bytes("config.json", lambda b: b"[" * 200_000 + b"]" * 200_000),
             "config.json: cannot be read as JSON (maximum recursion depth exceeded"),
    BadInput("config-json-of-the-dist-side-a-fifo", to_hf(lambda p: p.sources.dist, lambda p: _config_replaced(p, _fifo)),
             "config.json: cannot be read as JSON (it is a FIFO, not a regular file)"),
    BadInput("a-tensor-whose-name-is-5-mb-in-the-weights", hf_tensors(lambda t: t.update({LONG_NAME: torch.ones(1)})),
             "(5,000,021 characters), which its config.json has no place for"),
    BadInput("no-config-json", to_dist(lambda p: without(p.sources.llama, p.tmp / "m", "config.json")),
             "config.json: no such file", run="cli"),
    BadInput("no-weights", to_dist(lambda p: without(p.sources.llama, p.tmp / "m", "model.safetensors")),
             "no weights (model.safetensors or"),
    BadInput("missing-model-dir", to_dist(lambda p: p.tmp / "nothing-here"), "nothing-here: no such directory"),
    BadInput("heads-not-a-multiple-of-kv-heads", hf_config(num_key_value_heads=3),
             "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    BadInput("heads-that-disagree-with-the-shapes", hf_config(num_attention_heads=4),
             "tensor model.layers.0.self_attn.q_proj.weight has shape [64, 64], but its config.json makes it [32, 64]"),
    BadInput("biases-on-every-linear-layer", hf_config(attention_bias=True), "attention_bias=true has no Megatron conversion"),
    BadInput("architecture-without-a-conversion", hf_config(architectures=["MambaForCausalLM"]),
             "architecture MambaForCausalLM has no Megatron conversion"),
    BadInput("intermediate-size-that-disagrees", hf_config(intermediate_size=128),
             "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], but its config.json makes it [128, 64]"),
    BadInput("index-naming-a-missing-shard", to_dist(_index_naming_a_missing_shard),
             "tensor model.embed_tokens.weight is listed in model.safetensors.index.json in "
             "model-00002-of-00002.safetensors, which is missing"),
    # the dist side (to-hf)
    BadInput("config-of-4-layers-over-a-2-layer-checkpoint", tiny_dist_with_config(num_hidden_layers=4),
             "holds 2 decoder layers, but the config.json says num_hidden_layers=4"),
    BadInput("config-of-1-layer-over-a-2-layer-checkpoint", tiny_dist_with_config(num_hidden_layers=1),
             "holds 2 decoder layers, but the config.json says num_hidden_layers=1"),
    BadInput("metadata-garbage", dist_bytes(".metadata", lambda b: b"\x80\x04garbage"),
             ".metadata: not a torch DCP metadata file"),
    BadInput("metadata-that-runs-os.system", crafted_metadata, "refused: it asks to build posix.system", run="cli"),
    BadInput("distcp-missing", to_hf(lambda p: without(p.sources.dist, p.tmp / "d", "__0_0.distcp")),
             "is in __0_0.distcp, which is missing"),
    BadInput("distcp-cut-short", dist_bytes("__0_0.distcp", lambda b: b[: len(b) // 2]), "runs past the end of __0_0.distcp"),
    BadInput("a-chunk-missing", dist_metadata(_drop_chunk),
             f"tensor {QKV}: its chunks leave part of the tensor [3, 96, 64] unwritten"),
    BadInput("chunks-that-overlap", dist_metadata(_overlap_chunks), f"tensor {QKV}: chunks overlap at [0, 0, 0]"),
    BadInput("a-chunk-that-holds-another-shape", dist_metadata(_point_chunk_elsewhere),
             "holds torch.float32 [1, 96, 64], not the torch.float32 [1, 64] its metadata says"),
    BadInput("a-tensor-the-config-has-no-place-for", dist_metadata(_extra_tensor),
             "holds decoder.layers.mlp.extra.weight, which its config.json has no place for"),
    BadInput("metadata-a-tuple-200000-deep", _metadata_bytes(DEEP_TUPLE_KEY),
             ".metadata: refused: it nests objects more than 100 deep", run="cli"),
    BadInput("metadata-bytearray-of-4-gib", _metadata_bytes(BYTEARRAY_OF_4_GIB),
             "refused: it asks to build builtins.bytearray from int 4294967296", run="cli"),
    BadInput("a-tensor-whose-name-is-5-mb", dist_metadata(lambda m: m.state_dict_metadata.update(
        {LONG_NAME: m.state_dict_metadata[QKV]})), "(5,000,021 characters), which its config.json has no place for"),
    BadInput("metadata-a-fifo", to_hf(lambda p: _replaced(copy(p.sources.dist, p.tmp / "d"), ".metadata", _fifo)),
             ".metadata: cannot be read (it is a FIFO, not a regular file)", run="cli"),
    BadInput("no-metadata", to_hf(lambda p: without(p.sources.dist, p.tmp / "d", ".metadata")),
             "not a complete torch_dist checkpoint (no .metadata"),
    # OUT
    BadInput("out-exists", out_at(lambda p: (p.tmp / "out").mkdir() or p.tmp / "out"), "out exists; give a new directory"),
    BadInput("out-a-dangling-symlink", out_at(_dangling), "out is a symbolic link (to", run="cli"),
    BadInput("out-under-a-regular-file", out_at(_file), "a-file is a file, not a directory"),
    BadInput("out-on-a-read-only-filesystem", out_at(lambda p: read_only_dir(p) / "out"), "cannot write in"),
    BadInput("out-under-proc", out_at(lambda p: Path("/proc/converter-test/out")), "cannot create /proc/converter-test"),
    BadInput("out-whose-new-parent-is-removed-again", lambda p: ["to-dist", str(p.tmp / "nothing-here"),
                                                                 str(p.tmp / "new" / "parent" / "out")],
             "nothing-here: no such directory"),
    BadInput("out-made-by-another-process-meanwhile", out_at(lambda p: p.tmp / "out"),
             "out was made by another process during the conversion", run="cli-stopped", meanwhile=_made_by_another),
]


def run(case: BadInput, argv: list[str], place: Place) -> tuple[object, str, str, tuple]:
    """(exit code, stdout, stderr) of the converter on `argv`, and what was there (`snapshot`) as it ran."""
    out = Path(argv[-1])
    if case.run == "cli-stopped":
        with stopped_mid_way(argv) as process:
            case.meanwhile(out)
            before = snapshot(place.tmp, out, under_way=True)
            process.send_signal(signal.SIGCONT)
            stdout, stderr = process.communicate(timeout=HANG_GUARD_S)
        return process.returncode, stdout, stderr, before
    before = snapshot(place.tmp, out)
    if case.run == "main":
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(argv)
            except BaseException:  # reported as the command line would show it
                code = "raised"
                print(traceback.format_exc(), file=sys.stderr)
        return code, stdout.getvalue(), stderr.getvalue(), before
    done = subprocess.run(cli(*argv), capture_output=True, text=True, env=env(), cwd=ROOT, timeout=HANG_GUARD_S)
    return done.returncode, done.stdout, done.stderr, before


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def snapshot(folder: Path, out: Path, under_way: bool = False) -> tuple:
    """What is in the case's folder, and OUT: a link (to where), a directory (of what), or nothing;
    the partial of a conversion `under_way` aside."""
    link = os.readlink(out) if out.is_symlink() else None
    files = [name for name in tree(folder) if not (under_way and ".partial-" in name)]
    return files, link, tree(out) if out.is_dir() and link is None else os.path.lexists(out)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case.id for case in BAD_INPUTS])
def test_bad_input_is_one_error_line_exit_2_and_leaves_nothing(case, sources, tmp_path):
    place = Place(tmp_path / "case", sources)
    place.tmp.mkdir()
    try:
        argv = case.argv(place)
        out = Path(argv[-1])
        code, stdout, stderr, before = run(case, argv, place)
        assert "Traceback" not in stderr, stderr
        assert (code, stdout) == (2, ""), stderr
        assert len(stderr.splitlines()) == 1 and stderr.startswith("error: "), stderr[:4000]
        assert len(stderr) < 2100, f"an error line of {len(stderr):,} characters"
        assert case.says in stderr, stderr
        assert snapshot(place.tmp, out) == before, "the conversion left something behind, or changed OUT"
        if out.parent.is_dir():
            assert not list(out.parent.glob(f"*{out.name}.partial-*"))
        assert not (place.tmp / "code-ran").exists(), "the crafted .metadata ran its command"
    finally:
        for undo in place.finalizers:
            undo()
