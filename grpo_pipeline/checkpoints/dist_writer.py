"""megatron-core's `torch_dist` checkpoint, as this converter writes it and as megatron-core reads it
on a host without CUDA (`cpu_megatron`).

    python -m grpo_pipeline.checkpoints.convert to-dist HF_DIR OUT

The format is torch DCP, as megatron-core's `torch_dist` strategy writes it: one key per sharded
tensor, each chunk a `torch.save` stream in `__0_0.distcp` at the offset `.metadata` (a pickled
`Metadata`) records, plus `common.pt` and `metadata.json`. megatron-core's own writer preloads every
tensor; this one writes a chunk as it is given one, so peak memory is the largest chunk's.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from grpo_pipeline.checkpoints.dist_reader import tiling_problem

DATA_FILE = "__0_0.distcp"


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
    """Writes a torch_dist checkpoint chunk by chunk into `folder` (a staging directory);
    `finish()` checks that each tensor's chunks tile it and writes the metadata."""

    def __init__(self, folder: Path, checkpoint_id: str):
        self.folder, self.checkpoint_id = Path(folder), checkpoint_id
        self.stream = open(self.folder / DATA_FILE, "wb")
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.objects: dict[str, BytesStorageMetadata] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}

    def __enter__(self) -> DistCheckpointWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()

    def add_chunk(self, key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], chunk: torch.Tensor) -> None:
        """One chunk of a global tensor, at `offset`."""
        chunk = chunk.contiguous()
        if chunk.untyped_storage().nbytes() != chunk.nbytes:  # a view: torch.save would write its whole storage
            chunk = chunk.clone()
        meta = self.tensors.setdefault(key, TensorStorageMetadata(
            properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(global_shape), chunks=[]))
        if meta.properties.dtype != chunk.dtype or tuple(meta.size) != tuple(global_shape):
            raise ValueError(f"{key}: a chunk of {chunk.dtype} in a {list(global_shape)} tensor, which earlier chunks "
                             f"made {meta.properties.dtype} {list(meta.size)}")
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

    def finish(self) -> None:
        self.stream.close()
        for key, meta in self.tensors.items():
            if problem := tiling_problem(tuple(meta.size), meta.chunks):
                raise RuntimeError(f"writing {key}: {problem}")  # the layout's bug, not the input's
        metadata = Metadata(state_dict_metadata={**self.tensors, **self.objects}, planner_data=None,
                            storage_data=self.storage, storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id))
        with open(self.folder / ".metadata", "wb") as handle:
            pickle.dump(metadata, handle)
        torch.save({}, self.folder / "common.pt")
        (self.folder / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
