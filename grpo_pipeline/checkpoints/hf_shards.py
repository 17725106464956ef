"""The tensors of an HF safetensors directory, read a tensor at a time, trusting nothing in the files.

    python -m grpo_pipeline.checkpoints.convert to-dist HF_DIR OUT

A shard's header must lie inside its file and describe tensors whose bytes do too; `check` holds the
directory to the tensors a config implies (each there, of its shape, the parts of one fused tensor of
one dtype, nothing else) before a conversion writes a byte. Every failure is a `CheckpointError`, one
line naming the file and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import torch

from grpo_pipeline.store.bounded_read import MAX_JSON_BYTES, read_regular, short
from grpo_pipeline.errors import UserError

INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100_000_000  # the safetensors format's own limit on a header's length


class CheckpointError(UserError):
    """A checkpoint file that is damaged, or that does not hold what its config says."""


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one line saying why not."""
    try:
        value = json.loads(read_regular(Path(path), MAX_JSON_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file; {what}") from None
    except (OSError, ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser's depth
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError(f"{path}: cannot be read as JSON ({short(reason)}); {what}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}, not an object; {what}")
    return value


class HFTensors:
    """The tensors of an HF safetensors directory, each read when asked for with plain file reads at
    the offsets of its shard's header. Not mmapped (as `safe_open` does): every page of an mmapped
    shard that was read stays mapped and counts in the process's RSS until the shard is closed, so
    converting a model grew RSS by the model's size; a read tensor is the only copy held."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self._headers: dict[str, tuple[int, dict]] = {}
        if (self.dir / INDEX).is_file():
            weight_map = read_json(self.dir / INDEX, "fetch the model again").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and "/" not in f for f in weight_map.values()):
                raise CheckpointError(f"{self.dir / INDEX}: no weight_map of tensor names to shard files; fetch the model again")
            self.where: dict[str, str] = weight_map
        elif (self.dir / "model.safetensors").is_file():
            self.where = dict.fromkeys(self._header("model.safetensors")[1], "model.safetensors")
        else:
            raise CheckpointError(f"{self.dir}: no weights (model.safetensors or {INDEX}); give an HF model directory")

    def entry(self, name: str, shape: tuple[int, ...] | None = None) -> dict:
        """The header entry of `name`: dtype (torch), shape (checked against the `shape` its config
        implies, if given), data_offsets (checked against its file)."""
        file = self.where.get(name)
        if file is None:
            raise CheckpointError(f"{self.dir}: tensor {name} is not in the checkpoint; it does not match its config.json")
        if file not in self._headers and not (self.dir / file).is_file():
            raise CheckpointError(f"{self.dir}: tensor {name} is listed in {INDEX} in {short(file)}, which is missing; "
                                  "fetch the model again")
        header = self._header(file)[1]
        if name not in header:
            raise CheckpointError(f"{self.dir}: tensor {name} is listed in {INDEX} in {short(file)}, which does not hold it; "
                                  "fetch the model again")
        if shape is not None and tuple(header[name]["shape"]) != tuple(shape):
            raise CheckpointError(f"{self.dir}: tensor {name} has shape {header[name]['shape']}, but its config.json "
                                  f"makes it {list(shape)}")
        return header[name]

    def check(self, expected: dict[str, tuple[tuple[int, ...], str]], ignored: set[str]) -> None:
        """Every tensor of `expected` (name -> shape, the fused tensor it is part of) is here with its
        shape, the parts of one fused tensor share a dtype, and nothing else is here but `ignored`
        (a tied lm_head's stored copy, which transformers ignores too) and old rotary buffers."""
        dtypes: dict[str, tuple[str, torch.dtype]] = {}
        for name, (shape, fused) in expected.items():
            entry = self.entry(name, shape)
            first, dtype = dtypes.setdefault(fused, (name, entry["dtype"]))
            if entry["dtype"] != dtype:
                raise CheckpointError(f"{self.dir}: tensor {name} is {entry['dtype']}, but {first}, part of the same "
                                      f"Megatron tensor {fused}, is {dtype}; convert the checkpoint to one dtype first")
        unread = sorted(name for name in self.where if name not in expected and name not in ignored
                        and not name.endswith("rotary_emb.inv_freq"))
        if unread:
            raise CheckpointError(f"{self.dir}: holds tensor {short(unread[0])}" + (f" and {len(unread) - 1} more" if len(unread) > 1
                                  else "") + ", which its config.json has no place for; give the config the weights "
                                  "were saved with (or the model has parts the converter does not write)")

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, checked against the `shape` its config implies (a conversion always gives one)."""
        entry = self.entry(name, shape)
        file = self.where[name]
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.dir / file, "rb", buffering=0) as handle:  # unbuffered: straight into the tensor
            handle.seek(self._header(file)[0] + begin)
            view = memoryview(data.numpy())
            while view:
                read = handle.readinto(view)
                if not read:
                    raise CheckpointError(f"{self.dir}: {file} ends inside tensor {name}; fetch the model again")
                view = view[read:]
        return data.view(entry["dtype"]).reshape(entry["shape"])

    def _header(self, file: str) -> tuple[int, dict]:
        if file not in self._headers:
            self._headers[file] = safetensors_header(self.dir / file)
        return self._headers[file]


def safetensors_header(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its tensors (name -> torch dtype, shape,
    data_offsets), each checked to lie inside the file with as many bytes as its shape needs."""
    damaged = f"{path}: not a safetensors file"
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(0)
        if size < 8:
            raise CheckpointError(f"{damaged} ({size} bytes, shorter than its 8-byte header length); fetch the model again")
        length = int.from_bytes(handle.read(8), "little")
        if length > min(size - 8, MAX_HEADER):
            raise CheckpointError(f"{damaged} (its header length, {length} bytes, runs past the file's {size} bytes); "
                                  "fetch the model again")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{damaged} (its header is not JSON: {exc}); fetch the model again") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{damaged} (its header is not a JSON object); fetch the model again")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
                raise ValueError("shape and offsets must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{damaged} (tensor {short(name)}'s header entry is malformed: {short(repr(exc))}); "
                                  "fetch the model again") from None
        needed = int(numpy.prod(shape, dtype=object)) * torch.empty((), dtype=dtype).element_size()
        if not begin <= end <= data_size or end - begin != needed:
            raise CheckpointError(f"{path}: tensor {short(name)} spans bytes {begin}-{end} of {data_size}, but its "
                                  f"shape {short(shape)} needs {needed}; the file is cut short or damaged: fetch the model again")
        entry["dtype"] = dtype
    return 8 + length, header
