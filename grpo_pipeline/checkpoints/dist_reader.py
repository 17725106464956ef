"""A torch DCP (megatron-core `torch_dist`) checkpoint read a chunk at a time, trusting nothing in it.

    python -m grpo_pipeline.checkpoints.convert to-hf DIST_DIR HF_CONFIG_DIR OUT

`.metadata` is a pickle: it is loaded by `MetadataUnpickler`, which builds only the classes torch's
and megatron-core's writers put there, so a crafted file cannot run code in this process (torch's
own DCP reader, megatron-core and verl `pickle.load` the same file). `check` holds the checkpoint to
the tensors a config implies: each there, of its shape, its chunks tiling it exactly, each chunk in a
file of the checkpoint long enough to hold it, nothing else but `_extra_state` objects. Chunks are
read with `torch.load(weights_only=True)` and must be of the shape and dtype the metadata says.
"""

from __future__ import annotations

import io
import pickle
from bisect import bisect_left
from pathlib import Path

import numpy
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from grpo_pipeline.store.bounded_read import MAX_PICKLE_DEPTH, pickle_depth, read_regular, short
from grpo_pipeline.checkpoints.hf_shards import CheckpointError

# Megatron's metadata is ~300 bytes a chunk: a 1T-parameter model saved by 1,024 ranks stays far below.
MAX_METADATA_BYTES = 2 * 1024**3


class MetadataUnpickler(pickle.Unpickler):
    """Builds what a torch DCP `.metadata` holds and nothing else. The admitted classes are those
    megatron-core 0.16's `dist_checkpointing.save` and this converter's writer put there (listed from
    real files: tests/e2e/test_dist_checkpoint.py checks the list), plus plain-data builtins."""

    ADMITTED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # megatron-core keeps its save plan in `planner_data`
        *(("torch.distributed.checkpoint.planner", name) for name in (
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        *(("builtins", name) for name in ("set", "frozenset", "complex")),
    }

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "bytearray"):
            return _bytearray
        if (module, name) in self.ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # how torch pickles a dtype
            return getattr(torch, name)
        raise CheckpointError(f"{module}.{name}")


def _bytearray(data: bytes = b"") -> bytearray:
    """bytearray as a pickle rebuilds one (from its bytes), never from a count: `bytearray(2**32)`
    in a 34-byte file would allocate 4 GiB before anything could refuse it."""
    if not isinstance(data, bytes):
        raise CheckpointError(f"builtins.bytearray from {type(data).__name__} {short(repr(data), 40)}")
    return bytearray(data)


def load_metadata(path: Path) -> Metadata:
    """A DCP `.metadata`, built by `MetadataUnpickler` once its size and its nesting are known to be
    those of a metadata file (what the unpickler builds is hashed as it is built: a tuple nested
    100,000 deep overflows the C stack, a crash no exception handler sees)."""
    try:
        data = read_regular(path, MAX_METADATA_BYTES)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc}); the checkpoint is damaged: "
                              "save it again") from None
    try:
        depth = pickle_depth(data)
    except Exception as exc:  # whatever genops raises on a stream that is no pickle
        raise CheckpointError(f"{path}: not a torch DCP metadata file ({type(exc).__name__}: {short(exc)}); "
                              "the checkpoint is damaged: save it again") from None
    if depth is None:
        raise CheckpointError(f"{path}: refused: it nests objects more than {MAX_PICKLE_DEPTH} deep, which no "
                              "torch DCP metadata file does (built, it would crash this process); do not use "
                              "this checkpoint")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: refused: it asks to build {exc}, which a torch DCP metadata file does not "
                              "hold (a crafted checkpoint runs code when torch or megatron-core load it); "
                              "do not use this checkpoint") from None
    except Exception as exc:  # whatever a damaged pickle raises while being built
        raise CheckpointError(f"{path}: not a torch DCP metadata file ({type(exc).__name__}: {short(exc)}); "
                              "the checkpoint is damaged: save it again") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not torch DCP metadata with its storage "
                              "data; the checkpoint is damaged: save it again")
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not (isinstance(meta, BytesStorageMetadata) or _well_formed(meta)):
            raise CheckpointError(f"{path}: the entry of {short(repr(key))} is not a tensor's or an object's metadata; the "
                                  "checkpoint is damaged: save it again")
    return metadata


def _well_formed(meta) -> bool:
    """A TensorStorageMetadata whose fields are of their types (unpickling sets whatever a file says)."""
    chunks = getattr(meta, "chunks", None)
    return isinstance(meta, TensorStorageMetadata) and isinstance(getattr(meta, "size", None), torch.Size) \
        and isinstance(getattr(getattr(meta, "properties", None), "dtype", None), torch.dtype) \
        and isinstance(chunks, list) and all(isinstance(c, ChunkStorageMetadata) and isinstance(
            getattr(c, "offsets", None), torch.Size) and isinstance(getattr(c, "sizes", None), torch.Size) for c in chunks)


def tiling_problem(size: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> str | None:
    """What keeps the chunks from covering every element of a tensor of `size` exactly once (part
    of it would be read from no file, or from two), or None. Checked on the grid that all chunk
    edges cut the tensor into."""
    edges = []
    for dim, extent in enumerate(size):
        cuts = {0, extent}
        for chunk in chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size) or not all(
                    0 <= o and 0 < s and o + s <= e for o, s, e in zip(offsets, sizes, size)):
                return f"a chunk at {list(offsets)} of size {list(sizes)} lies outside the tensor's {list(size)}"
            cuts.update((offsets[dim], offsets[dim] + sizes[dim]))
        edges.append(sorted(cuts))
    if numpy.prod([len(cuts) - 1 for cuts in edges], dtype=object) > 64 * len(chunks) + 10**6:  # memory, not a layout
        return f"its {len(chunks)} chunks cut it into more pieces than any writer's layout does"
    covered = numpy.zeros([len(cuts) - 1 for cuts in edges], dtype=bool)
    for chunk in chunks:
        cells = covered[tuple(slice(bisect_left(cuts, o), bisect_left(cuts, o + s))
                              for cuts, o, s in zip(edges, chunk.offsets, chunk.sizes))]
        if cells.any():
            return f"chunks overlap at {list(chunk.offsets)}"
        cells[...] = True
    if not covered.all():
        return f"its chunks leave part of the tensor {list(size)} unwritten"
    return None


class DistCheckpointReader:
    """The tensors of a torch_dist checkpoint, checked against what a config implies (`check`), then
    read one chunk at a time from their files."""

    EMBEDDING = "embedding.word_embeddings.weight"

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / ".metadata").exists():  # a FIFO or a device there is load_metadata's to name
            raise CheckpointError(f"{self.path}: not a complete torch_dist checkpoint (no .metadata, which is written last)")
        self.metadata = load_metadata(self.path / ".metadata")
        # A model saved inside a wrapper (verl's `dist_checkpointing_prefix`, a VL model's
        # `language_model.`) has every key prefixed; the embedding's key tells which prefix.
        found = [k for k in self.metadata.state_dict_metadata if k.endswith(self.EMBEDDING)]
        if len(found) != 1:
            raise CheckpointError(f"{self.path}: {len(found)} word-embedding tensors (*{self.EMBEDDING}); "
                                  "not a GPTModel checkpoint")
        self.prefix = found[0][: -len(self.EMBEDDING)]
        self.checked: dict[str, TensorStorageMetadata] = {}
        self._file_sizes: dict[str, int | None] = {}

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every key of `expected` is a tensor of its shape whose chunks tile it, each in a file long
        enough; nothing else is there but `_extra_state` objects (TransformerEngine's, not weights)."""
        found = self.metadata.state_dict_metadata
        for key, shape in expected.items():
            meta = found.get(self.prefix + key)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: no tensor {self.prefix + key}, which its config.json implies; "
                                      "give the config the checkpoint was saved with")
            size = tuple(meta.size)
            if size != shape:
                if key.startswith("decoder.layers.") and size[1:] == shape[1:]:  # stacked: [layer, ...]
                    raise CheckpointError(f"{self.path}: holds {size[0]} decoder layers, but the config.json says "
                                          f"num_hidden_layers={shape[0]}; give the config the checkpoint was saved with")
                raise CheckpointError(f"{self.path}: tensor {self.prefix + key} has shape {list(size)}, but the "
                                      f"config.json makes it {list(shape)}; give the config the checkpoint was saved with")
            if problem := tiling_problem(size, meta.chunks):
                raise CheckpointError(f"{self.path}: tensor {self.prefix + key}: {problem}; the checkpoint is "
                                      "damaged or incomplete: save it again")
            for chunk in meta.chunks:
                self._storage(self.prefix + key, chunk)
            self.checked[key] = meta
        ours = {self.prefix + key for key in expected}
        unexpected = sorted(k for k, meta in found.items() if k not in ours
                            and not (isinstance(meta, BytesStorageMetadata) and "._extra_state/" in k))
        if unexpected:
            raise CheckpointError(f"{self.path}: holds {short(unexpected[0])}" + (f" and {len(unexpected) - 1} more keys"
                                  if len(unexpected) > 1 else "") + ", which its config.json has no place for; give "
                                  "the config the checkpoint was saved with (or this model has parts the converter "
                                  "does not write)")

    def tensor(self, key: str) -> torch.Tensor:
        """The whole global tensor of `key` (checked), assembled from its chunks."""
        meta = self.checked[key]
        whole = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)  # every element written: chunks tile it
        for chunk in meta.chunks:
            whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = self._chunk(key, chunk)
        return whole

    def layer(self, key: str, index: int) -> torch.Tensor:
        """Layer `index` of a stacked (checked) `decoder.layers.*` tensor: only the chunks holding it are read."""
        meta = self.checked[key]
        part = torch.empty(tuple(meta.size)[1:], dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            first = chunk.offsets[0]
            if first <= index < first + chunk.sizes[0]:
                part[tuple(slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:]))] = \
                    self._chunk(key, chunk)[index - first]
        return part

    def _storage(self, fqn: str, chunk: ChunkStorageMetadata) -> _StorageInfo:
        """Where a chunk is: a file of the checkpoint (no path outside it), long enough to hold it."""
        where = f"{self.path}: tensor {fqn}'s chunk at {list(chunk.offsets)}"
        info = self.metadata.storage_data.get(MetadataIndex(fqn=fqn, offset=chunk.offsets))
        name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name \
                or name in ("", ".", "..") or not all(type(n) is int and n >= 0 for n in (offset, length)) \
                or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} has no storage entry this reader can use; the checkpoint is damaged: save it again")
        if info.relative_path not in self._file_sizes:
            file = self.path / info.relative_path
            self._file_sizes[info.relative_path] = file.stat().st_size if file.is_file() else None
        size = self._file_sizes[info.relative_path]
        if size is None:
            raise CheckpointError(f"{where} is in {info.relative_path}, which is missing; the checkpoint is incomplete: "
                                  "copy it again")
        if info.offset + info.length > size:
            raise CheckpointError(f"{where} runs past the end of {info.relative_path}; the file is cut short: copy it again")
        return info

    def _chunk(self, key: str, chunk: ChunkStorageMetadata) -> torch.Tensor:
        fqn, meta = self.prefix + key, self.checked[key]
        info = self._storage(fqn, chunk)
        with open(self.path / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            blob = handle.read(info.length)
        try:
            data = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as exc:  # whatever a damaged torch.save stream raises
            raise CheckpointError(f"{self.path}: tensor {fqn}'s chunk at {list(chunk.offsets)} cannot be read "
                                  f"({type(exc).__name__}); the checkpoint is damaged: save it again") from None
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(chunk.sizes) \
                or data.dtype != meta.properties.dtype:
            raise CheckpointError(f"{self.path}: tensor {fqn}'s chunk at {list(chunk.offsets)} holds "
                                  f"{getattr(data, 'dtype', type(data).__name__)} {list(getattr(data, 'shape', []))}, "
                                  f"not the {meta.properties.dtype} {list(chunk.sizes)} its metadata says; the "
                                  "checkpoint is damaged: save it again")
        return data
