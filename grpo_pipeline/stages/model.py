"""The `prepare_checkpoint` stage (`prepare_model`): the base model as a verified HF directory.

    python -m grpo_pipeline --model tiny --stages prepare_checkpoint
    python -m grpo_pipeline --model Qwen/Qwen3-0.6B --set model.revision=<commit> --stages prepare_checkpoint

Sources, from `model.path`:
- `builtin:tiny`, `builtin:smollm2-135m`: made here (`data/builtin_models.py`), once, into the store;
- a hub repo id: the config, tokenizer and safetensors files (`model.files`) at the pinned revision,
  fetched once into the store under `model.root` with the same retry / verify / atomic rules as data;
- a local HF directory: used in place, after checking that it is complete.

Every directory handed on is checked: the config loads, every tensor the safetensors index names is in
its shard, and the tensors' shapes are those of the model the config describes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.hf_config import architecture_from_hf_config
from grpo_pipeline.profiles.yaml_files import path_kind
from grpo_pipeline.profiles.schema import ModelArchitecture, ModelSection
from grpo_pipeline.store.bounded_read import MAX_JSON_BYTES, read_regular, short
from grpo_pipeline.data.builtin_models import BUILDERS
from grpo_pipeline.store.content import Built, Store, fingerprint, read_manifest

BUILTIN_PREFIX = "builtin:"
INDEX_FILE = "model.safetensors.index.json"
# Bumped when a builder's output changes, so built models are made again.
BUILDER_VERSION = 1


class ModelFormatError(UserError):
    """A model directory that cannot be trained from as it is."""


class ModelSpec(BaseModel):
    source_kind: Literal["builtin", "hub", "local"]
    source: str = Field(..., description="Builder name, repo id, or absolute local directory.")
    revision: str = "main"
    files: list[str] = Field(default_factory=list)
    root: Path = Field(..., description="Store root for downloaded and built models.")
    trust_remote_code: bool = False
    dist_checkpoint: bool = Field(False, description="Also make a megatron-core dist checkpoint of it.")

    @classmethod
    def from_profile(cls, model: ModelSection) -> ModelSpec:
        root = Path(model.root).expanduser().resolve()
        common = {"root": root, "trust_remote_code": model.trust_remote_code, "dist_checkpoint": model.dist_checkpoint}
        if model.path.startswith(BUILTIN_PREFIX):
            name = model.path.removeprefix(BUILTIN_PREFIX)
            if name not in BUILDERS:
                raise UserError(f"model.path={model.path!r}: no such built-in model; use one of "
                                f"{', '.join(BUILTIN_PREFIX + n for n in BUILDERS)}")
            return cls(source_kind="builtin", source=name, **common)
        local = Path(model.path).expanduser()
        is_dir = path_kind(local, "model.path") == "dir"
        if model.path.startswith(("/", ".", "~")) or is_dir:
            if not is_dir:
                raise UserError(f"model.path={model.path!r} is not a directory; give a local HF directory or a hub repo id")
            return cls(source_kind="local", source=str(local.resolve()), **common)
        return cls(source_kind="hub", source=model.path, revision=model.revision, files=model.files, **common)

    def identity(self) -> dict[str, Any]:
        if self.source_kind == "builtin":
            return {"builder": self.source, "version": BUILDER_VERSION}
        return {"repo": self.source, "revision": self.revision, "files": self.files}

    @property
    def store_name(self) -> str:
        return self.source.replace("/", "--")

    @property
    def dist_store_name(self) -> str:
        """The store name of its megatron-core dist checkpoint."""
        return f"{self.store_name}--torch_dist"


class DistCheckpoint(BaseModel):
    path: str = Field(..., description="megatron-core torch_dist directory (global shapes: loads at any TP/PP/EP).")
    source_sha256: str = Field(..., description="Digest of the HF weights it was converted from.")
    converter: int = Field(..., description="Converter version that wrote it.")
    cached: bool


class ModelCheckpoint(BaseModel):
    path: str = Field(..., description="HF directory: config, tokenizer, safetensors.")
    source: str
    revision: str | None = None
    commit: str | None = Field(None, description="Commit the revision resolved to (hub sources).")
    model_type: str
    num_parameters: int = Field(..., description="Elements of all weight tensors in the checkpoint.")
    weight_bytes: int
    cached: bool = Field(..., description="True when nothing was fetched or built.")
    dist_checkpoint: DistCheckpoint | None = Field(
        None, description="The same weights as a megatron-core dist checkpoint (`model.dist_checkpoint`).")


def model_dir(spec: ModelSpec) -> Path:
    """Where the model's HF directory is (or will be), known without fetching it."""
    if spec.source_kind == "local":
        return Path(spec.source)
    return Store(spec.root).path_for(spec.store_name, spec.identity())


def prepare_model(spec: ModelSpec, expected: ModelArchitecture | None = None, log=print) -> ModelCheckpoint:
    """The verified HF directory of the base model. `expected`: the architecture the profile was
    validated with (parallel layout, heads vs TP...), which the checkpoint's config must confirm."""
    if spec.source_kind == "local":
        facts = verify_hf_dir(Path(spec.source), spec.trust_remote_code)
        check_architecture(Path(spec.source), expected)
        return ModelCheckpoint(path=spec.source, source=spec.source, cached=True, **facts)
    entry = Store(spec.root).get_or_build(spec.store_name, spec.identity(), lambda scratch, out: _build(spec, scratch, out), log)
    check_architecture(entry.path, expected)
    details = entry.manifest.details
    return ModelCheckpoint(
        path=str(entry.path),
        source=spec.source,
        revision=spec.revision if spec.source_kind == "hub" else None,
        commit=details.get("commit"),
        cached=entry.cached,
        **details["checked"],
    )


def source_digest(model_path: Path) -> str:
    """What the HF weights are: for a store entry, the digest of its manifest's file hashes (no file is
    read); for a local directory, of its files' names, sizes and mtimes (hashing 244 GB per run would
    cost minutes)."""
    manifest = read_manifest(model_path)
    if manifest is None:
        return "local:" + (fingerprint(model_path) or "")
    files = sorted((name, record.sha256) for name, record in manifest.files.items())
    return "sha256:" + hashlib.sha256(json.dumps(files).encode()).hexdigest()


def dist_identity(model_path: Path) -> dict[str, Any]:
    """The dist checkpoint's store key: the source weights, the target layout, the converter."""
    from grpo_pipeline.checkpoints.megatron_layout import CONVERTER_VERSION, DIST_LAYOUT

    return {"source": source_digest(model_path), "layout": DIST_LAYOUT, "converter": CONVERTER_VERSION}


def dist_checkpoint_dir(spec: ModelSpec, model_path: Path) -> Path:
    """Where the dist checkpoint of the HF weights at `model_path` is (or will be)."""
    return Store(spec.root).path_for(spec.dist_store_name, dist_identity(model_path))


def prepare_dist_checkpoint(spec: ModelSpec, model_path: Path, log=print) -> DistCheckpoint:
    """The base model as a megatron-core dist checkpoint, converted once (streamed, on CPU) into the
    store next to the HF weights, so each rank of a large run reads only its shard."""
    from grpo_pipeline.checkpoints.megatron_layout import CONVERTER_VERSION, hf_to_dist

    identity = dist_identity(model_path)

    def convert(scratch: Path, out: Path) -> Built:
        hf_to_dist(model_path, out, log=log)  # staged beside `out`, renamed over the store's empty `out`
        return Built(details={"source_path": str(model_path)})

    entry = Store(spec.root).get_or_build(spec.dist_store_name, identity, convert, log)
    return DistCheckpoint(path=str(entry.path), source_sha256=identity["source"], converter=CONVERTER_VERSION,
                          cached=entry.cached)


# Numbers a recipe may leave empty (only checked when known): not a different architecture.
OPTIONAL_NUMBERS = {"max_position_embeddings"}


def check_architecture(path: Path, expected: ModelArchitecture | None) -> None:
    if expected is None:
        return
    found = architecture_from_hf_config(path)
    wrong = [
        f"model.architecture.{name}={getattr(expected, name)} but config.json says {value}"
        for name, value in found.items()
        if value is not None and getattr(expected, name) != value
        and not (name in OPTIONAL_NUMBERS and getattr(expected, name) is None)
    ]
    if wrong:
        raise ModelFormatError(
            f"{path}: the profile was validated for another architecture: {'; '.join(wrong)}; "
            "fix the recipe's model.architecture (or --set it) to match the checkpoint"
        )


def _build(spec: ModelSpec, scratch: Path, out: Path) -> Built:
    from grpo_pipeline.store.hub import fetch_snapshot

    built = Built()
    if spec.source_kind == "builtin":
        built.details["built"] = BUILDERS[spec.source](out)
    else:
        download = scratch / "download"
        snapshot = fetch_snapshot(spec.source, "model", spec.revision, spec.files, download)
        for name in snapshot.files:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(download / name, out / name)
        built.details["commit"] = snapshot.commit
        built.sha256 = snapshot.sha256
    built.details["checked"] = verify_hf_dir(out, spec.trust_remote_code)
    return built


def verify_hf_dir(path: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Facts of a complete HF model directory, or ModelFormatError saying what is wrong with it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    if not (path / "config.json").exists():
        raise ModelFormatError(f"{path}: no config.json; give the directory of a Hugging Face model")
    for name in ("config.json", INDEX_FILE):  # bounded before transformers reads them whole
        try:
            if (path / name).exists():
                json.loads(read_regular(path / name, MAX_JSON_BYTES))
        except (OSError, ValueError, RecursionError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else short(exc)
            raise ModelFormatError(f"{path / name}: cannot be read as JSON ({reason}); fetch the model again") from None
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelFormatError(f"{path}/config.json does not load: {exc}") from exc
    shards = _weight_shards(path)
    shapes: dict[str, tuple[int, ...]] = {}
    weight_bytes = 0
    for shard, expected_names in shards.items():
        try:
            with safe_open(path / shard, framework="pt") as handle:
                names = set(handle.keys())
                for name in names:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:
            raise ModelFormatError(f"{path / shard}: not a readable safetensors file ({exc}); fetch it again") from exc
        weight_bytes += (path / shard).stat().st_size
        missing = sorted(expected_names - names)
        if missing:
            raise ModelFormatError(f"{path / shard}: missing {len(missing)} tensor(s) the index lists, e.g. {missing[0]}")
    _check_shapes(path, config, shapes, trust_remote_code)
    num_parameters = 0
    for shape in shapes.values():
        count = 1
        for dim in shape:
            count *= dim
        num_parameters += count
    return {"model_type": config.model_type, "num_parameters": num_parameters, "weight_bytes": weight_bytes}


def _weight_shards(path: Path) -> dict[str, set[str]]:
    """Shard file -> tensor names the index promises (empty set: a single unindexed file)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelFormatError(f"{index}: unreadable index ({exc})") from exc
        shards: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, set()).add(name)
        absent = sorted(s for s in shards if not (path / s).is_file())
        if absent:
            raise ModelFormatError(f"{path}: {len(absent)} shard(s) of the index are missing, e.g. {absent[0]}; fetch them again")
        return shards
    if (path / "model.safetensors").is_file():
        return {"model.safetensors": set()}
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    hint = f" (found {others[0]}: convert it to safetensors)" if others else ""
    raise ModelFormatError(f"{path}: no safetensors weights{hint}")


def _check_shapes(path: Path, config, shapes: dict[str, tuple[int, ...]], trust_remote_code: bool) -> None:
    """The checkpoint's tensors against the model its config builds (on the meta device: no memory).
    Names are compared where they match; a checkpoint whose names follow another layout (fused
    experts, a multimodal wrapper) is checked on the tensors the two share."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return  # an architecture transformers cannot build here; the engine will load it its own way
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    wrong = [f"{n} {shapes[n]} (config says {expected[n]})" for n in expected if n in shapes and shapes[n] != expected[n]]
    if wrong:
        raise ModelFormatError(f"{path}: tensor shapes do not match config.json: {'; '.join(wrong[:3])}")
    missing = [n for n in expected if n not in shapes]
    if missing and not set(shapes) - set(expected):
        raise ModelFormatError(f"{path}: {len(missing)} weight tensor(s) missing, e.g. {missing[0]}")
