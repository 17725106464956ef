"""Streaming HF -> megatron-core dist checkpoint (`hf_to_dist`) vs the disk, and vs loading the whole model first.

    .venv/bin/python bench/bench_dist_checkpoint.py [--shape qwen3-1.7b|qwen3-4b] [--shard-gb 1] [--rounds 1] [--dir /tmp]

Writes a model of a real model's shape, random bf16 weights, as safetensors shards of ~--shard-gb GB
(tensor by tensor: no transformers model in memory), then in each round, on the same files, with the
page cache dropped before each (root only; else noted: warm for every side alike):
  disk    the shards read once (64 MB reads), the same bytes written once and fsynced: read and write
          GB/s, and "read+write", the time the disk needs to read and write the model's bytes once.
  stream  `hf_to_dist(model, out)` in a child, timed to the end of a sync (it does not fsync itself).
  whole   in a child, every shard through `safetensors.torch.load_file`, the same fused keys (QKV,
          gate+up) per layer, one `torch.distributed.checkpoint.save` without a process group (fsyncs).
Per child: peak RSS (VmHWM) and the peaks of RssAnon and RssFile polled every 50 ms from
/proc/<pid>/status (touched pages of an mmapped shard are RssFile). Goals of `stream`: >= 0.7 x the
disk's read+write speed, peak RSS < 2 x the largest tensor group it holds at once + the fixed
overhead (the RSS of a child that only imports torch, safetensors and grpo_pipeline.checkpoints.convert).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9
SHAPES = {  # the config.json fields of the real models (bf16, tied embeddings)
    "qwen3-1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936},
    "qwen3-4b": {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936},
}


def hf_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a dense Qwen3 with tied embeddings, HF names and shapes, in HF's order."""
    h, q, kv, ffn = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    names = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                  (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                  (p + "self_attn.q_norm.weight", (c["head_dim"],)), (p + "self_attn.k_norm.weight", (c["head_dim"],)),
                  (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                  (p + "mlp.down_proj.weight", (h, ffn))]
    return names + [("model.norm.weight", (h,))]


def largest_group(c: dict) -> tuple[str, int]:
    """The biggest set of tensors hf_to_dist holds at once (bf16 bytes): the embedding, one layer's
    q+k+v (fused into one), gate+up (linear_fc1) or down."""
    h, ffn = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"] * h
    groups = {"embedding": c["vocab_size"] * h, "q+k+v": qkv, "gate+up": 2 * ffn * h, "down": ffn * h}
    name = max(groups, key=groups.get)
    return name, 2 * groups[name]


def write_model(out: Path, c: dict, shard_bytes: float) -> list[Path]:
    """Safetensors shards written directly, a tensor at a time (no transformers model in memory)."""
    import torch

    out.mkdir(parents=True)
    shards, size = [[]], 0
    for name, shape in hf_tensors(c):
        if shards[-1] and size + 2 * torch.Size(shape).numel() > shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append((name, shape))
        size += 2 * torch.Size(shape).numel()
    weight_map, files = {}, []
    for n, tensors in enumerate(shards):
        file = out / f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + 2 * torch.Size(shape).numel()]}
            at = header[name]["data_offsets"][1]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        with open(file, "wb") as handle:
            handle.write(len(raw).to_bytes(8, "little") + raw)
            for name, shape in tensors:
                tensor = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else \
                    torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02)
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        weight_map.update({name: file.name for name, _ in tensors})
        files.append(file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **c, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "hidden_act": "silu",
        "attention_bias": False, "torch_dtype": "bfloat16"}, indent=1))
    return files


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk(files: list[Path], scratch: Path) -> tuple[float, float]:
    """Seconds to read every shard once, then to write the same bytes to a new file and fsync it."""
    buffer = memoryview(bytearray(64 << 20))
    started = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    with open(scratch, "wb", buffering=0) as out:  # the shards are cached now: this times the writes
        for file in files:
            with open(file, "rb", buffering=0) as handle:
                while n := handle.readinto(buffer):
                    out.write(buffer[:n])
        os.fsync(out.fileno())
    write_s = time.perf_counter() - started
    scratch.unlink()
    return read_s, write_s


def watch(*args: str) -> dict:
    """This script as a child (`--child ...`): its report, plus the peaks polled from /proc/<pid>/status."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    child = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, env=env, text=True)
    peaks = {"RssAnon": 0, "RssFile": 0}

    def poll() -> None:
        while child.poll() is None:
            try:
                lines = Path(f"/proc/{child.pid}/status").read_text().splitlines()
            except OSError:
                break
            fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines) if k in peaks}
            for key, value in fields.items():
                peaks[key] = max(peaks[key], value)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    stdout, _ = child.communicate()
    poller.join()
    if child.returncode:
        raise SystemExit(f"child {args} failed ({child.returncode})")
    return {**json.loads(stdout.strip().splitlines()[-1]), **peaks}


def run_child(mode: str, model: Path, out: Path) -> None:
    # The fixed overhead: what every child imports.
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    from grpo_pipeline.checkpoints import megatron_layout as dist_checkpoint

    started = time.perf_counter()
    if mode == "stream":
        dist_checkpoint.hf_to_dist(model, out)
    elif mode == "whole":
        save_whole(model, out)
    converted = time.perf_counter()
    if mode != "idle":
        os.sync()  # written bytes on disk, as the disk's own write is timed
    # Peak RSS: VmHWM, not ru_maxrss, which after exec keeps the parent's peak (having written the model).
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": time.perf_counter() - started, "sync_s": time.perf_counter() - converted,
                      "maxrss": int(hwm.split()[1]) * 1024}))


def save_whole(model: Path, out: Path) -> None:
    """Load every tensor (`load_file` maps the shard: its tensors are file pages), fuse as hf_to_dist
    does (per-layer keys: no process group, no sharding), save as DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from grpo_pipeline.checkpoints.megatron_layout import fused_qkv as _fused_qkv

    config = json.loads((model / "config.json").read_text())
    where = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    hf: dict[str, torch.Tensor] = {}
    for file in sorted(set(where.values())):
        hf.update(load_file(model / file))
    loaded = types.SimpleNamespace(get=lambda name, shape=None: hf[name])  # what _fused_qkv reads from

    state = {"embedding.word_embeddings.weight": hf.pop("model.embed_tokens.weight"),
             "decoder.final_layernorm.weight": hf.pop("model.norm.weight")}
    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    for i in range(config["num_hidden_layers"]):
        p, d = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[d + "self_attention.linear_qkv.weight"] = _fused_qkv(loaded, p, "weight", heads, groups, head_dim)
        state[d + "mlp.linear_fc1.weight"] = torch.cat([hf.pop(p + "mlp.gate_proj.weight"), hf.pop(p + "mlp.up_proj.weight")])
        for name in ("q", "k", "v"):
            del hf[f"{p}self_attn.{name}_proj.weight"]
        for key, name in (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm"),
                          ("self_attention.linear_proj.weight", "self_attn.o_proj"),
                          ("self_attention.q_layernorm.weight", "self_attn.q_norm"),
                          ("self_attention.k_layernorm.weight", "self_attn.k_norm"),
                          ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm"),
                          ("mlp.linear_fc2.weight", "mlp.down_proj")):
            state[d + key] = hf.pop(f"{p}{name}.weight")
    assert not hf, sorted(hf)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(out), no_dist=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-1.7b")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="shard size of the model written (default 1 GB)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of disk / stream / whole (medians)")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes (default: the system's temp dir)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_child(args.child[0], Path(args.child[1]), Path(args.child[2]))
    shape = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="bench-dist-checkpoint-", dir=args.dir))
    try:
        started = time.perf_counter()
        files = write_model(work / "hf", shape, args.shard_gb * GB)
        model_bytes = sum(f.stat().st_size for f in files)
        print(f"{args.shape}: {model_bytes / GB:.2f} GB in {len(files)} shards, written in {time.perf_counter() - started:.0f} s")
        overhead = watch("idle", str(work / "hf"), str(work / "none"))["maxrss"]
        runs: dict[str, list[dict]] = {"disk": [], "stream": [], "whole": []}
        dropped = True
        for round_ in range(args.rounds):
            dropped &= drop_caches()
            read_s, write_s = disk(files, work / "copy")
            runs["disk"].append({"read": read_s, "write": write_s, "seconds": read_s + write_s})
            for mode in ("stream", "whole") if round_ % 2 == 0 else ("whole", "stream"):  # alternate who goes first
                dropped &= drop_caches()
                runs[mode].append(watch(mode, str(work / "hf"), str(work / mode)))
                shutil.rmtree(work / mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    group_name, group = largest_group(shape)
    budget = 2 * group + overhead
    both = median("disk", "seconds")
    print(f"page cache: {'dropped before each read' if dropped else 'NOT dropped (not root): warm for every side alike'}; "
          f"medians of {args.rounds} round(s)")
    print(f"largest group: {group_name} {group / GB:.3f} GB; fixed overhead (child importing torch, safetensors, "
          f"grpo_pipeline.checkpoints.convert): {overhead / GB:.3f} GB; RSS budget 2 x group + overhead = {budget / GB:.2f} GB")
    print(f"disk: read {model_bytes / median('disk', 'read') / GB:.2f} GB/s ({median('disk', 'read'):.1f} s), "
          f"write+fsync {model_bytes / median('disk', 'write') / GB:.2f} GB/s ({median('disk', 'write'):.1f} s), "
          f"read+write {both:.1f} s = {model_bytes / both / GB:.2f} GB/s")
    print(f"\n{'path':<28} {'s':>7} {'(sync s)':>9} {'GB/s':>6} {'r+w / s':>8} {'peak RSS':>9} {'RssAnon':>8} "
          f"{'RssFile':>8} {'RSS / budget':>13}")
    for mode, label in (("stream", "hf_to_dist (streaming)"), ("whole", "load whole + dcp.save")):
        seconds, peak = median(mode, "seconds"), median(mode, "maxrss")
        print(f"{label:<28} {seconds:>7.1f} {median(mode, 'sync_s'):>9.1f} {model_bytes / seconds / GB:>6.2f} "
              f"{both / seconds:>8.2f} {peak / GB:>6.2f} GB {median(mode, 'RssAnon') / GB:>5.2f} GB "
              f"{median(mode, 'RssFile') / GB:>5.2f} GB {peak / budget:>13.3f}")
    print("(RssAnon / RssFile: their peaks, polled every 50 ms; r+w / s: the disk's read+write time over the path's)")
    print(f"\ncommand: .venv/bin/python bench/bench_dist_checkpoint.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
