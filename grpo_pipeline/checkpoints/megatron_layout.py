"""HF Llama / Qwen2 / Qwen3 / Qwen3-MoE weights in megatron-core 0.16's GPTModel layout, both ways.

    python -m grpo_pipeline.checkpoints.convert to-dist HF_DIR OUT
    python -m grpo_pipeline.checkpoints.convert to-hf DIST_DIR HF_CONFIG_DIR OUT

HF safetensors -> the checkpoint GPTModel loads with `dist_checkpointing.load(model.sharded_state_dict(),
path, strict=...)` (global shapes: at any TP / PP / EP; grouped-GEMM and per-expert MoE experts
share its keys), and back. The checkpoint stage makes one when `model.dist_checkpoint` asks
(stages/model.py); the export stage turns a verl step's dist checkpoint back into HF
(backends/verl/checkpoint.py). Decoder layers are stacked on a leading axis (one chunk per layer),
`linear_fc1` is a gate and an up chunk, each linear layer's `_extra_state` is bytes per layer.

The config is the contract: `hf_plan` and `dist_plan` list every tensor it implies with its shape,
and a conversion checks its whole input against them (every tensor there, of its shape, nothing
else) before it writes a byte, then reads and writes one tensor at a time into a staging folder
renamed into place (peak memory: the largest fused tensor).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_pipeline.checkpoints.dist_reader import DistCheckpointReader
from grpo_pipeline.checkpoints.dist_writer import DistCheckpointWriter
from grpo_pipeline.checkpoints.hf_shards import INDEX, CheckpointError, HFTensors, read_json
from grpo_pipeline.checkpoints.staged_output import StagedOutput, note

# Bumped when the files written for the same weights change, so stored conversions are made again.
CONVERTER_VERSION = 1
DIST_LAYOUT = "megatron-core 0.16 GPTModel torch_dist, global shapes (loads at any TP/PP/EP)"
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
LAYERS, EXPERTS = "decoder.layers.", "mlp.experts.experts."
PACKED = "mlp.experts.gate_up_proj"  # HF experts packed in one tensor per layer (gate rows, then up)


@dataclass(frozen=True)
class ModelShape:
    """What a config.json says the weights are."""

    architecture: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int  # 0 in a MoE model
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0
    expert_ffn: int = 0


def model_shape(model_dir: Path) -> ModelShape:
    """The checked shape of the model whose config.json is in `model_dir`."""
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: no such directory; give an HF model directory")
    path = Path(model_dir) / "config.json"
    config = read_json(path, "give an HF model directory with its config.json")
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else "(none)"
    if architecture not in SUPPORTED:
        raise CheckpointError(f"{model_dir}: architecture {architecture} has no Megatron conversion (supported: "
                              f"{', '.join(SUPPORTED)}); let the engine load the HF weights (use_dist_checkpointing=false)")

    def size(name: str, default: int | None = None) -> int:
        value = default if config.get(name) is None else config[name]  # null: as if absent, as transformers reads it
        if type(value) is not int or value <= 0:
            raise CheckpointError(f"{path}: {name} is {'missing' if value is None else repr(value)}; it must be a "
                                  "positive integer: give the model's own config.json")
        return value

    heads = size("num_attention_heads")
    groups = size("num_key_value_heads", heads)
    hidden = size("hidden_size")
    if heads % groups:
        raise CheckpointError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}; "
                              "give the model's own config.json")
    if config.get("head_dim") is None and hidden % heads:
        raise CheckpointError(f"{path}: no head_dim, and hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads}; give the model's own config.json")
    tied = config.get("tie_word_embeddings", False)
    if type(tied) is not bool:
        raise CheckpointError(f"{path}: tie_word_embeddings is {tied!r}; it must be true or false")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag) and architecture != "Qwen2ForCausalLM":  # Qwen2's QKV bias is its architecture's
            raise CheckpointError(f"{path}: {flag}=true has no Megatron conversion here (biases on every linear "
                                  "layer); let the engine load the HF weights (use_dist_checkpointing=false)")
    experts = expert_ffn = ffn = 0
    if architecture == "Qwen3MoeForCausalLM":
        experts = size("num_experts" if "num_experts" in config else "num_local_experts")  # transformers 5: the latter
        expert_ffn = size("moe_intermediate_size")
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError(f"{path}: dense layers in a MoE model (mlp_only_layers, decoder_sparse_step) have "
                                  "no Megatron conversion here; let the engine load the HF weights "
                                  "(use_dist_checkpointing=false)")
    else:
        ffn = size("intermediate_size")
    return ModelShape(architecture=architecture, layers=size("num_hidden_layers"), hidden=hidden, heads=heads,
                      groups=groups, head_dim=size("head_dim", hidden // heads), ffn=ffn, vocab=size("vocab_size"),
                      tied=tied, qkv_bias=architecture == "Qwen2ForCausalLM",
                      qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                      experts=experts, expert_ffn=expert_ffn)


def hf_plan(m: ModelShape, packed_experts: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF tensor the config implies: name -> (shape, the dist key it is part of)."""
    h, hd, q_rows, kv_rows = m.hidden, m.head_dim, m.heads * m.head_dim, m.groups * m.head_dim
    plan = {"model.embed_tokens.weight": ((m.vocab, h), "embedding.word_embeddings.weight"),
            "model.norm.weight": ((h,), "decoder.final_layernorm.weight")}
    if not m.tied:
        plan["lm_head.weight"] = ((m.vocab, h), "output_layer.weight")
    qkv = "self_attention.linear_qkv."
    layer = {"input_layernorm.weight": ((h,), qkv + "layer_norm_weight"),
             "self_attn.q_proj.weight": ((q_rows, h), qkv + "weight"),
             "self_attn.k_proj.weight": ((kv_rows, h), qkv + "weight"),
             "self_attn.v_proj.weight": ((kv_rows, h), qkv + "weight"),
             "self_attn.o_proj.weight": ((h, q_rows), "self_attention.linear_proj.weight"),
             # megatron-core's key for the pre-MLP norm, MoE layers included (the TE-style key map)
             "post_attention_layernorm.weight": ((h,), "mlp.linear_fc1.layer_norm_weight")}
    if m.qkv_bias:
        layer.update({f"self_attn.{n}_proj.bias": ((rows,), qkv + "bias") for n, rows in (("q", q_rows), ("k", kv_rows),
                                                                                         ("v", kv_rows))})
    if m.qk_norm:
        layer.update({f"self_attn.{n}_norm.weight": ((hd,), f"self_attention.{n}_layernorm.weight") for n in "qk"})
    if not m.experts:
        layer.update({"mlp.gate_proj.weight": ((m.ffn, h), "mlp.linear_fc1.weight"),
                      "mlp.up_proj.weight": ((m.ffn, h), "mlp.linear_fc1.weight"),
                      "mlp.down_proj.weight": ((h, m.ffn), "mlp.linear_fc2.weight")})
    else:
        e, f, fc1, fc2 = m.experts, m.expert_ffn, EXPERTS + "linear_fc1.weight", EXPERTS + "linear_fc2.weight"
        layer["mlp.gate.weight"] = ((e, h), "mlp.router.weight")
        if packed_experts:
            layer.update({PACKED: ((e, 2 * f, h), fc1), "mlp.experts.down_proj": ((e, h, f), fc2)})
        else:
            for x in range(e):
                layer.update({f"mlp.experts.{x}.gate_proj.weight": ((f, h), fc1),
                              f"mlp.experts.{x}.up_proj.weight": ((f, h), fc1),
                              f"mlp.experts.{x}.down_proj.weight": ((h, f), fc2)})
    for i in range(m.layers):
        plan.update({f"model.layers.{i}.{name}": (shape, LAYERS + key) for name, (shape, key) in layer.items()})
    return plan


def dist_plan(m: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every dist tensor the config implies, with its global shape (decoder layers stacked first)."""
    h, hd = m.hidden, m.head_dim
    plan = {"embedding.word_embeddings.weight": (m.vocab, h), "decoder.final_layernorm.weight": (h,)}
    if not m.tied:
        plan["output_layer.weight"] = (m.vocab, h)
    qkv_rows = (m.heads + 2 * m.groups) * hd
    layer = {"self_attention.linear_qkv.layer_norm_weight": (h,), "self_attention.linear_qkv.weight": (qkv_rows, h),
             "self_attention.linear_proj.weight": (h, m.heads * hd), "mlp.linear_fc1.layer_norm_weight": (h,)}
    if m.qkv_bias:
        layer["self_attention.linear_qkv.bias"] = (qkv_rows,)
    if m.qk_norm:
        layer.update({f"self_attention.{n}_layernorm.weight": (hd,) for n in "qk"})
    if not m.experts:
        layer.update({"mlp.linear_fc1.weight": (2 * m.ffn, h), "mlp.linear_fc2.weight": (h, m.ffn)})
    else:
        e, f = m.experts, m.expert_ffn
        layer.update({"mlp.router.weight": (e, h), EXPERTS + "linear_fc1.weight": (e, 2 * f, h),
                      EXPERTS + "linear_fc2.weight": (e, h, f)})
    plan.update({LAYERS + key: (m.layers, *shape) for key, shape in layer.items()})
    return plan


def hf_to_dist(model_dir: Path, out: Path, log: Callable[[str], None] = note, empty_dir_ok: bool = True) -> Path:
    """An HF directory of a SUPPORTED architecture as a megatron-core torch_dist checkpoint at `out`
    (`out` is checked first; it may be an empty directory if `empty_dir_ok`)."""
    with StagedOutput(out, log, empty_dir_ok=empty_dir_ok) as staged:
        m = model_shape(model_dir)
        hf = HFTensors(model_dir)
        source, target = hf_plan(m, m.experts > 0 and any(n.endswith(PACKED) for n in hf.where)), dist_plan(m)
        hf.check(source, ignored={"lm_head.weight"} if m.tied else set())

        def get(name: str) -> torch.Tensor:
            return hf.get(name, source[name][0])

        with DistCheckpointWriter(staged.path, str(out)) as writer:
            for name, (shape, key) in source.items():
                if not name.startswith("model.layers."):
                    writer.add_chunk(key, target[key], (0,) * len(shape), get(name))
            for i in range(m.layers):
                p = f"model.layers.{i}."

                def stacked(key: str, tensor: torch.Tensor, at: tuple[int, ...] = ()) -> None:
                    shape = target[LAYERS + key]
                    offset = (i, *at, *[0] * (len(shape) - 1 - len(at)))
                    writer.add_chunk(LAYERS + key, shape, offset, tensor[(None,) * (len(shape) - tensor.dim())])

                stacked("self_attention.linear_qkv.layer_norm_weight", get(p + "input_layernorm.weight"))
                for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
                    stacked(f"self_attention.linear_qkv.{kind}", fused_qkv(hf, p, kind, m.heads, m.groups, m.head_dim))
                stacked("self_attention.linear_proj.weight", get(p + "self_attn.o_proj.weight"))
                if m.qk_norm:
                    stacked("self_attention.q_layernorm.weight", get(p + "self_attn.q_norm.weight"))
                    stacked("self_attention.k_layernorm.weight", get(p + "self_attn.k_norm.weight"))
                stacked("mlp.linear_fc1.layer_norm_weight", get(p + "post_attention_layernorm.weight"))
                for linear in LINEARS[:2] if m.experts else LINEARS:
                    writer.add_object(f"{LAYERS}{linear}._extra_state", (i,), (m.layers,), None)
                if not m.experts:
                    stacked("mlp.linear_fc1.weight", get(p + "mlp.gate_proj.weight"))
                    stacked("mlp.linear_fc1.weight", get(p + "mlp.up_proj.weight"), (m.ffn,))
                    stacked("mlp.linear_fc2.weight", get(p + "mlp.down_proj.weight"))
                    continue
                # Experts in megatron-core's per-expert layout (SequentialMLP): stacked on [layer,
                # expert], each expert's linear_fc1 in a gate and an up chunk.
                stacked("mlp.router.weight", get(p + "mlp.gate.weight"))
                f = m.expert_ffn
                if p + PACKED in source:
                    gate_ups, downs = get(p + PACKED), get(p + "mlp.experts.down_proj")
                for e in range(m.experts):
                    if p + PACKED in source:
                        gate, up, down = *gate_ups[e].split(f), downs[e]
                    else:
                        gate, up, down = (get(f"{p}mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
                    stacked(EXPERTS + "linear_fc1.weight", gate, (e,))
                    stacked(EXPERTS + "linear_fc1.weight", up, (e, f))
                    stacked(EXPERTS + "linear_fc2.weight", down, (e,))
                    for linear in ("linear_fc1", "linear_fc2"):
                        writer.add_object(f"{LAYERS}{EXPERTS}{linear}._extra_state", (i, e), (m.layers, m.experts), None)
            if set(writer.tensors) != set(target):  # the layout's bug, not the input's
                raise RuntimeError(f"wrote {sorted(writer.tensors)}, the plan has {sorted(target)}")
            writer.finish()
        return staged.commit()


def fused_qkv(hf, prefix: str, kind: str, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's fused QKV: per query group, its queries, then its key, then its value (shapes
    checked beforehand: `HFTensors.check`)."""
    q, k, v = (hf.get(f"{prefix}self_attn.{name}_proj.{kind}") for name in "qkv")
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, heads // groups * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def dist_to_hf(dist_dir: Path, config_dir: Path, out: Path, packed_experts: bool | None = None,
               log: Callable[[str], None] = note) -> Path:
    """The inverse of `hf_to_dist`: HF safetensors named as in `config_dir`'s model (its config and
    tokenizer files are copied), written layer by layer. MoE experts are written packed
    (`mlp.experts.gate_up_proj`) when `packed_experts`, or, when it is None, when config_dir's own
    weights are packed; else one module each, as transformers saves them."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with StagedOutput(out, log) as staged:
        m = model_shape(config_dir)
        if packed_experts is None:
            packed_experts = m.experts > 0 and any((Path(config_dir) / f).is_file() for f in ("model.safetensors", INDEX)) \
                and any(name.endswith(PACKED) for name in HFTensors(config_dir).where)
        names = hf_plan(m, packed_experts)
        reader = DistCheckpointReader(dist_dir)
        reader.check(dist_plan(m))
        files: dict[str, str] = {}

        def shard(file: str, tensors: dict[str, torch.Tensor]) -> None:
            wrong = [name for name, t in tensors.items() if name not in names or tuple(t.shape) != names[name][0]]
            if wrong:  # the layout's bug, not the input's
                raise RuntimeError(f"{file}: {wrong} are not in the plan, or not of its shape")
            try:
                save_file({k: v.contiguous() for k, v in tensors.items()}, staged.path / file, metadata={"format": "pt"})
            except SafetensorError as exc:  # its I/O errors (a full disk) are not OSErrors
                raise OSError(f"writing {file}: {exc}") from None
            files.update(dict.fromkeys(tensors, file))

        shard("model-embeddings.safetensors", {name: reader.tensor(key) for name, (shape, key) in names.items()
                                               if not name.startswith("model.layers.")})
        for i in range(m.layers):
            p, layer = f"model.layers.{i}.", {}

            def get(key: str) -> torch.Tensor:
                return reader.layer(LAYERS + key, i)

            layer[p + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
            for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
                fused = get(f"self_attention.linear_qkv.{kind}")
                rest, per_group = fused.shape[1:], m.heads // m.groups * m.head_dim
                parts = fused.reshape(m.groups, per_group + 2 * m.head_dim, *rest).split(
                    [per_group, m.head_dim, m.head_dim], dim=1)
                for name, part in zip("qkv", parts):
                    layer[f"{p}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *rest)
            layer[p + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
            if m.qk_norm:
                layer[p + "self_attn.q_norm.weight"] = get("self_attention.q_layernorm.weight")
                layer[p + "self_attn.k_norm.weight"] = get("self_attention.k_layernorm.weight")
            layer[p + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight")
            if not m.experts:
                layer[p + "mlp.gate_proj.weight"], layer[p + "mlp.up_proj.weight"] = get("mlp.linear_fc1.weight").split(
                    [m.ffn, m.ffn], dim=0)
                layer[p + "mlp.down_proj.weight"] = get("mlp.linear_fc2.weight")
            else:  # experts named as in config_dir
                layer[p + "mlp.gate.weight"] = get("mlp.router.weight")
                fc1, fc2 = get(EXPERTS + "linear_fc1.weight"), get(EXPERTS + "linear_fc2.weight")
                if packed_experts:
                    layer[p + PACKED], layer[p + "mlp.experts.down_proj"] = fc1, fc2
                else:
                    for e in range(m.experts):
                        gate, up = fc1[e].chunk(2, dim=0)
                        layer[f"{p}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                        layer[f"{p}mlp.experts.{e}.up_proj.weight"] = up.clone()
                        layer[f"{p}mlp.experts.{e}.down_proj.weight"] = fc2[e].clone()
            shard(f"model-layer-{i:05d}.safetensors", layer)
        if set(files) != set(names):  # the layout's bug, not the input's
            raise RuntimeError(f"wrote {len(files)} tensors, the plan has {len(names)}")
        (staged.path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": files}, indent=1))
        for item in Path(config_dir).iterdir():
            if item.is_file() and not item.name.endswith(".safetensors") and item.name != INDEX:
                shutil.copyfile(item, staged.path / item.name)  # not copy2: the output's modes are this run's
        return staged.commit()
