"""Megatron-core distributed checkpoints (`torch_dist`) written a tensor at a time, without a GPU.

    python -m common.dist_checkpoint to-dist HF_DIR OUT
    python -m common.dist_checkpoint to-hf DIST_DIR HF_CONFIG_DIR OUT

HF safetensors of a Llama / Qwen2 / Qwen3 / Qwen3-MoE model -> the checkpoint megatron-core 0.16's
GPTModel loads with `dist_checkpointing.load(model.sharded_state_dict(), path, strict=...)` (global
shapes: at any TP / PP / EP; grouped-GEMM and per-expert MoE experts share its keys), and back. The
checkpoint stage makes one when `model.dist_checkpoint` asks (stages/model.py), and the export stage
turns a verl step's dist checkpoint back into HF (backends/verl/checkpoint.py).

The format is torch DCP, as megatron-core's `torch_dist` strategy writes it: one key per sharded
tensor, decoder layers stacked on a leading axis (one chunk per layer), `linear_fc1` in a gate and an
up chunk, each linear layer's `_extra_state` as bytes per layer, plus `common.pt` and
`metadata.json`. megatron-core's own writer preloads every tensor; this one reads, fuses and writes
one tensor at a time (peak memory: the largest fused tensor), into a staging folder renamed into place.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from profiles.errors import EXIT_USER_ERROR, UserError

DATA_FILE = "__0_0.distcp"
# Bumped when the files written for the same weights change, so stored conversions are made again.
CONVERTER_VERSION = 1
DIST_LAYOUT = "megatron-core 0.16 GPTModel torch_dist, global shapes (loads at any TP/PP/EP)"
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """megatron-core on a host without CUDA: the one place its CUDA assumptions are neutralised.
    Its checkpoint code calls `torch.cuda.synchronize()` and puts small tensors on
    `torch.cuda.current_device()`; RoPE moves its frequencies there. On CPU both become no-ops.
    Without TransformerEngine, megatron-core 0.16's MoE router reads a `te_general_gemm` its import
    guard never defined: it is defined as absent, so the router uses torch's matmul."""
    if torch.cuda.is_available():
        yield
        return
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch("torch.cuda.synchronize", lambda *args, **kwargs: None))
        patches.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
        if moe_utils is not None and not hasattr(moe_utils, "te_general_gemm"):
            patches.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        yield


class DistCheckpointWriter:
    """Writes a torch_dist checkpoint chunk by chunk into `<out>.partial-*`, renamed to `out` on close."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.staging = self.out.with_name(f"{self.out.name}.partial-{uuid.uuid4().hex[:8]}")
        self.staging.mkdir(parents=True)
        self.stream = open(self.staging / DATA_FILE, "wb")
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.objects: dict[str, BytesStorageMetadata] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}

    def add_chunk(self, key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], chunk: torch.Tensor) -> None:
        """One chunk of a global tensor, at `offset`."""
        chunk = chunk.contiguous()
        if chunk.untyped_storage().nbytes() != chunk.nbytes:  # a view: torch.save would write its whole storage
            chunk = chunk.clone()
        meta = self.tensors.setdefault(key, TensorStorageMetadata(
            properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(global_shape), chunks=[]))
        if meta.properties.dtype != chunk.dtype or tuple(meta.size) != tuple(global_shape):
            raise ValueError(f"{key}: chunk dtype/shape disagree with the tensor's")
        meta.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=chunk.shape))
        self.storage[MetadataIndex(fqn=key, offset=torch.Size(offset))] = self._write(lambda s: torch.save(chunk, s))

    def add_object(self, key: str, index: tuple[int, ...], count: tuple[int, ...], value) -> None:
        """A ShardedObject's part (megatron-core's `<key>/shard_<offset>_<shape>`, dot-joined, its value
        in a list, as megatron-core writes it)."""
        fqn = f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, count))}"
        self.objects[fqn] = BytesStorageMetadata()
        buffer = io.BytesIO()
        torch.save([value], buffer)
        self.storage[MetadataIndex(fqn=fqn)] = self._write(lambda s: s.write(buffer.getvalue()))

    def _write(self, write) -> _StorageInfo:
        offset = self.stream.tell()
        write(self.stream)
        return _StorageInfo(relative_path=DATA_FILE, offset=offset, length=self.stream.tell() - offset)

    def close(self) -> Path:
        self.stream.close()
        metadata = Metadata(state_dict_metadata={**self.tensors, **self.objects}, planner_data=None,
                            storage_data=self.storage, storage_meta=StorageMeta(checkpoint_id=str(self.out)))
        with open(self.staging / ".metadata", "wb") as handle:
            pickle.dump(metadata, handle)
        torch.save({}, self.staging / "common.pt")
        (self.staging / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
        os.replace(self.staging, self.out)
        return self.out

    def abort(self) -> None:
        self.stream.close()
        shutil.rmtree(self.staging, ignore_errors=True)


class HFTensors:
    """The tensors of an HF safetensors directory, each read when asked for with plain file reads at
    the offsets of its shard's header. Not mmapped (as `safe_open` does): every page of an mmapped
    shard that was read stays mapped and counts in the process's RSS until the shard is closed, so
    converting a model grew RSS by the model's size; a read tensor is the only copy held."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        else:
            self.where = dict.fromkeys(_safetensors_header(self.dir / "model.safetensors")[1], "model.safetensors")
        self._headers: dict[str, tuple[int, dict]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, checked against the `shape` the config implies."""
        file = self.where.get(name)
        if file is None:
            raise UserError(f"{self.dir}: tensor {name} is not in the checkpoint; it does not match its config.json")
        if file not in self._headers:
            if not (self.dir / file).is_file():
                raise UserError(f"{self.dir}: tensor {name} is listed in model.safetensors.index.json in {file}, "
                                "which is missing; fetch the model again")
            self._headers[file] = _safetensors_header(self.dir / file)
        start, header = self._headers[file]
        if name not in header:
            raise UserError(f"{self.dir}: tensor {name} is listed in model.safetensors.index.json in {file}, "
                            "which does not hold it; fetch the model again")
        entry = header[name]
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.dir / file, "rb", buffering=0) as handle:  # unbuffered: straight into the tensor
            handle.seek(start + begin)
            view = memoryview(data.numpy())
            while view:
                read = handle.readinto(view)
                if not read:
                    raise UserError(f"{self.dir}: {file} ends inside tensor {name}; fetch the model again")
                view = view[read:]
        tensor = data.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise UserError(f"{self.dir}: tensor {name} has shape {list(tensor.shape)}, but its config.json makes it "
                            f"{list(shape)}")
        return tensor


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def _safetensors_header(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header's tensors (name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def hf_to_dist(model_dir: Path, out: Path) -> Path:
    """An HF directory of a SUPPORTED architecture as a megatron-core torch_dist checkpoint at `out`
    (staged beside it, renamed into place; `out` may be an empty directory)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architecture = (config.get("architectures") or ["(none)"])[0]
    if architecture not in SUPPORTED:
        raise UserError(f"{model_dir}: architecture {architecture} has no Megatron conversion (supported: "
                        f"{', '.join(SUPPORTED)}); let the engine load the HF weights (use_dist_checkpointing=false)")
    hf = HFTensors(model_dir)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    writer = DistCheckpointWriter(out)
    try:
        whole = {"embedding.word_embeddings.weight": ("model.embed_tokens.weight", (vocab, hidden)),
                 "decoder.final_layernorm.weight": ("model.norm.weight", (hidden,))}
        if not config.get("tie_word_embeddings", False):
            whole["output_layer.weight"] = ("lm_head.weight", (vocab, hidden))
        for key, (name, shape) in whole.items():
            tensor = hf.get(name, shape)
            writer.add_chunk(key, tuple(tensor.shape), (0,) * tensor.dim(), tensor)
        for i in range(layers):
            p = f"model.layers.{i}."

            def stacked(key: str, tensor: torch.Tensor, at: int = 0, full: tuple[int, ...] | None = None) -> None:
                shape = full or tuple(tensor.shape)
                writer.add_chunk(f"decoder.layers.{key}", (layers, *shape), (i, at, *([0] * (len(shape) - 1))),
                                 tensor.unsqueeze(0))

            stacked("self_attention.linear_qkv.layer_norm_weight", hf.get(p + "input_layernorm.weight", (hidden,)))
            stacked("self_attention.linear_qkv.weight", _fused_qkv(hf, p, "weight", heads, groups, head_dim))
            if p + "self_attn.q_proj.bias" in hf:
                stacked("self_attention.linear_qkv.bias", _fused_qkv(hf, p, "bias", heads, groups, head_dim))
            stacked("self_attention.linear_proj.weight", hf.get(p + "self_attn.o_proj.weight", (hidden, heads * head_dim)))
            if p + "self_attn.q_norm.weight" in hf:
                stacked("self_attention.q_layernorm.weight", hf.get(p + "self_attn.q_norm.weight"))
                stacked("self_attention.k_layernorm.weight", hf.get(p + "self_attn.k_norm.weight"))
            for linear in LINEARS[:2]:
                writer.add_object(f"decoder.layers.{linear}._extra_state", (i,), (layers,), None)
            # megatron-core's key for the pre-MLP norm, MoE layers included (the TE-style key map).
            stacked("mlp.linear_fc1.layer_norm_weight", hf.get(p + "post_attention_layernorm.weight"))
            if p + "mlp.gate.weight" not in hf:
                stacked("mlp.linear_fc1.weight", hf.get(p + "mlp.gate_proj.weight", (ffn, hidden)), 0, (2 * ffn, hidden))
                stacked("mlp.linear_fc1.weight", hf.get(p + "mlp.up_proj.weight", (ffn, hidden)), ffn, (2 * ffn, hidden))
                stacked("mlp.linear_fc2.weight", hf.get(p + "mlp.down_proj.weight", (hidden, ffn)))
                for linear in LINEARS[2:]:
                    writer.add_object(f"decoder.layers.{linear}._extra_state", (i,), (layers,), None)
                continue
            # A MoE layer, experts in megatron-core's per-expert layout (SequentialMLP): stacked on
            # [layer, expert], each expert's linear_fc1 in a gate and an up chunk.
            stacked("mlp.router.weight", hf.get(p + "mlp.gate.weight"))
            experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5 writes the latter
            expert_ffn = config["moe_intermediate_size"]
            fc1 = "decoder.layers.mlp.experts.experts.linear_fc1"
            fc2 = "decoder.layers.mlp.experts.experts.linear_fc2"
            # HF keeps experts one module each or packed in one tensor per layer (gate rows, then up).
            packed = p + "mlp.experts.gate_up_proj" in hf
            if packed:
                gate_ups = hf.get(p + "mlp.experts.gate_up_proj", (experts, 2 * expert_ffn, hidden))
                downs = hf.get(p + "mlp.experts.down_proj", (experts, hidden, expert_ffn))
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                if packed:
                    gate, up, down = *gate_ups[e].split(expert_ffn), downs[e]
                else:
                    gate, up, down = (hf.get(q + f"{name}.weight", shape) for name, shape in (
                        ("gate_proj", (expert_ffn, hidden)), ("up_proj", (expert_ffn, hidden)), ("down_proj", (hidden, expert_ffn))))
                for at, part in ((0, gate), (expert_ffn, up)):
                    writer.add_chunk(f"{fc1}.weight", (layers, experts, 2 * expert_ffn, hidden), (i, e, at, 0), part[None, None])
                writer.add_chunk(f"{fc2}.weight", (layers, experts, hidden, expert_ffn), (i, e, 0, 0), down[None, None])
                for linear in (fc1, fc2):
                    writer.add_object(f"{linear}._extra_state", (i, e), (layers, experts), None)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _fused_qkv(hf: HFTensors, prefix: str, kind: str, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's fused QKV: per query group, its queries, then its key, then its value."""
    hidden = [hf.get(f"{prefix}self_attn.q_proj.weight").shape[1]] if kind == "weight" else []
    q = hf.get(f"{prefix}self_attn.q_proj.{kind}", (heads * head_dim, *hidden))
    k, v = (hf.get(f"{prefix}self_attn.{name}_proj.{kind}", (groups * head_dim, *hidden)) for name in ("k", "v"))
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, heads // groups * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def _has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file()


class DistCheckpointReader:
    """The chunks of a torch_dist checkpoint, read one at a time from their files."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise UserError(f"{self.path}: not a complete torch_dist checkpoint (no .metadata, which is written last)")
        with open(self.path / ".metadata", "rb") as handle:
            self.metadata: Metadata = pickle.load(handle)
        # A model saved inside a wrapper (verl's `dist_checkpointing_prefix`, a VL model's
        # `language_model.`) has every key prefixed; the embedding's key tells which prefix.
        embedding = "embedding.word_embeddings.weight"
        found = [k for k in self.metadata.state_dict_metadata if k.endswith(embedding)]
        if len(found) != 1:
            raise UserError(f"{self.path}: {len(found)} word-embedding tensors (*{embedding}); not a GPTModel checkpoint")
        self.prefix = found[0][: -len(embedding)]

    def tensor(self, key: str) -> torch.Tensor:
        """The whole global tensor of `key`, assembled from its chunks."""
        key = self.prefix + key
        meta = self.metadata.state_dict_metadata[key]
        whole = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            info = self.metadata.storage_data[MetadataIndex(fqn=key, offset=chunk.offsets)]
            with open(self.path / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                data = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True)
            whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = data
        return whole

    def layer(self, key: str, index: int) -> torch.Tensor:
        """Layer `index` of a stacked `decoder.layers.*` tensor (only its chunks are read)."""
        key = self.prefix + key
        meta = self.metadata.state_dict_metadata[key]
        part = torch.empty(tuple(meta.size)[1:], dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            if chunk.offsets[0] != index:
                continue
            info = self.metadata.storage_data[MetadataIndex(fqn=key, offset=chunk.offsets)]
            with open(self.path / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                data = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True)[0]
            part[tuple(slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:]))] = data
        return part

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.metadata.state_dict_metadata


def dist_to_hf(dist_dir: Path, config_dir: Path, out: Path, packed_experts: bool | None = None) -> Path:
    """The inverse of `hf_to_dist`: HF safetensors named as in `config_dir`'s model (its config and
    tokenizer files are copied), written layer by layer, into a staging folder renamed into place.
    MoE experts are written packed (`mlp.experts.gate_up_proj`) when `packed_experts`, or, when it is
    None, when config_dir's own weights are packed; else one module each, as transformers saves them."""
    from safetensors.torch import save_file

    config = json.loads((Path(config_dir) / "config.json").read_text())
    if packed_experts is None:
        packed_experts = _has_weights(Path(config_dir)) and any(
            name.endswith("mlp.experts.gate_up_proj") for name in HFTensors(config_dir).where)
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    ffn = config["intermediate_size"]
    reader = DistCheckpointReader(dist_dir)
    staging = Path(out).with_name(f"{Path(out).name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        files: dict[str, str] = {}

        def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, staging / name, metadata={"format": "pt"})
            files.update(dict.fromkeys(tensors, name))

        top = {"model.embed_tokens.weight": reader.tensor("embedding.word_embeddings.weight"),
               "model.norm.weight": reader.tensor("decoder.final_layernorm.weight")}
        if "output_layer.weight" in reader:
            top["lm_head.weight"] = reader.tensor("output_layer.weight")
        shard("model-embeddings.safetensors", top)
        for i in range(config["num_hidden_layers"]):
            p, layer = f"model.layers.{i}.", {}

            def get(key: str) -> torch.Tensor:
                return reader.layer(f"decoder.layers.{key}", i)

            layer[p + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
            for kind in ("weight", "bias"):
                if f"decoder.layers.self_attention.linear_qkv.{kind}" in reader:
                    fused = get(f"self_attention.linear_qkv.{kind}")
                    rest = fused.shape[1:]
                    per_group = fused.reshape(groups, (heads // groups + 2) * head_dim, *rest)
                    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
                    for name, part in (("q", q), ("k", k), ("v", v)):
                        layer[f"{p}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *rest)
            layer[p + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
            if "decoder.layers.self_attention.q_layernorm.weight" in reader:
                layer[p + "self_attn.q_norm.weight"] = get("self_attention.q_layernorm.weight")
                layer[p + "self_attn.k_norm.weight"] = get("self_attention.k_layernorm.weight")
            layer[p + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight")
            if "decoder.layers.mlp.router.weight" in reader:  # a MoE layer, experts named as in config_dir
                layer[p + "mlp.gate.weight"] = get("mlp.router.weight")
                fc1, fc2 = get("mlp.experts.experts.linear_fc1.weight"), get("mlp.experts.experts.linear_fc2.weight")
                if packed_experts:
                    layer[p + "mlp.experts.gate_up_proj"], layer[p + "mlp.experts.down_proj"] = fc1, fc2
                    shard(f"model-layer-{i:05d}.safetensors", layer)
                    continue
                for e in range(fc1.shape[0]):
                    gate, up = fc1[e].chunk(2, dim=0)
                    layer[f"{p}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                    layer[f"{p}mlp.experts.{e}.up_proj.weight"] = up.clone()
                    layer[f"{p}mlp.experts.{e}.down_proj.weight"] = fc2[e].clone()
            else:
                gate, up = get("mlp.linear_fc1.weight").split([ffn, ffn], dim=0)
                layer[p + "mlp.gate_proj.weight"], layer[p + "mlp.up_proj.weight"] = gate, up
                layer[p + "mlp.down_proj.weight"] = get("mlp.linear_fc2.weight")
            shard(f"model-layer-{i:05d}.safetensors", layer)
        (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}, indent=1))
        for item in Path(config_dir).iterdir():
            if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
                shutil.copy2(item, staging / item.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """`python -m common.dist_checkpoint to-dist HF_DIR OUT` / `to-hf DIST_DIR CONFIG_DIR OUT`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.dist_checkpoint",
                                     description="Convert between HF safetensors and megatron-core torch_dist, streamed, on CPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    to_dist = commands.add_parser("to-dist", help="HF directory -> dist checkpoint")
    to_dist.add_argument("model_dir", type=Path)
    to_dist.add_argument("out", type=Path)
    to_hf = commands.add_parser("to-hf", help="dist checkpoint -> HF directory (config and tokenizer from CONFIG_DIR)")
    to_hf.add_argument("dist_dir", type=Path)
    to_hf.add_argument("config_dir", type=Path)
    to_hf.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"error: {args.out} exists; give a new directory (nothing is written over)", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        out = hf_to_dist(args.model_dir, args.out) if args.command == "to-dist" else dist_to_hf(
            args.dist_dir, args.config_dir, args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
