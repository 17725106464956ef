"""Work in progress (issue 15): an HF model written as a megatron-core torch_dist checkpoint, a tensor
at a time, loads into megatron-core's GPTModel (local layer spec, TP=PP=1) with strict key checking
and gives the HF model's logits; the inverse gives back every tensor bit for bit; bad input is one
line with nothing left behind."""

from __future__ import annotations

import pytest
import torch

from common.dist_checkpoint import cpu_megatron, hf_to_dist


@pytest.fixture(scope="module")
def megatron_cpu():
    """One process group of one rank (gloo, an in-process store: no port), TP=PP=1, and
    megatron-core's RNG tracker in its inference form (its training form needs CUDA RNG states).
    The group is destroyed after the module: later tests of this process must not see one."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def gpt_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    qk_norm = config.model_type in ("qwen3", "qwen3_moe")
    moe = dict(num_moe_experts=getattr(config, "num_experts", None) or config.num_local_experts, moe_router_topk=config.num_experts_per_tok,
               moe_ffn_hidden_size=config.moe_intermediate_size, moe_token_dispatcher_type="allgather",
               moe_router_load_balancing_type="none", moe_router_pre_softmax=False) if config.model_type == "qwen3_moe" else {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    transformer = TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads, ffn_hidden_size=config.intermediate_size, kv_channels=head_dim,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=config.model_type == "qwen2", qk_layernorm=qk_norm, use_cpu_initialization=True, layernorm_epsilon=config.rms_norm_eps,
        attention_dropout=0.0, hidden_dropout=0.0, **moe)
    spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), qk_layernorm=qk_norm, normalization="RMSNorm")
    return GPTModel(config=transformer, transformer_layer_spec=spec,
                    vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=config.rope_parameters["rope_theta"],
                    share_embeddings_and_output_weights=config.tie_word_embeddings)


@pytest.mark.parametrize("kind", ["tiny-qwen3", "qwen2", "llama", "qwen3-moe"])
def test_a_converted_model_loads_strictly_and_gives_the_hf_logits(megatron_cpu, tiny_model_dir, tmp_path, kind):
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    source = tiny_model_dir if kind == "tiny-qwen3" else _tiny(tmp_path / "hf", kind)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    out = hf_to_dist(source, tmp_path / "dist")
    assert not list(tmp_path.glob("dist.partial-*"))  # the staging folder was renamed into place
    model = gpt_model(hf.config).eval()
    with cpu_megatron():
        state = dist_checkpointing.load(model.sharded_state_dict(), str(out), strict="raise_all")
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12))
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]  # the default is built on CUDA
    with torch.no_grad(), cpu_megatron():
        logits = model(tokens, torch.arange(12)[None].expand(2, -1), mask)
        assert torch.allclose(logits, hf(tokens).logits, atol=1e-5, rtol=0)


def _tiny(tmp_path, kind: str):
    """A tiny random model of an architecture family, saved as HF safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, tie_word_embeddings=False)
    config = {"qwen2": Qwen2Config(**common), "llama": LlamaConfig(**common),
              "qwen3-moe": Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=True)}[kind]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if kind == "qwen2":  # random QKV biases: zeros would hide a mis-ordered bias
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
    model.save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind", ["tiny-qwen3", "qwen2", "llama", "qwen3-moe"])
def test_hf_to_dist_to_hf_is_bit_exact(tiny_model_dir, tmp_path, kind):

    from common.dist_checkpoint import HFTensors, dist_to_hf

    source = tiny_model_dir if kind == "tiny-qwen3" else _tiny(tmp_path, kind)
    back = dist_to_hf(hf_to_dist(source, tmp_path / "dist"), source, tmp_path / "back")
    original, again = HFTensors(source), HFTensors(back)
    assert set(original.where) == set(again.where)
    for name in original.where:
        assert torch.equal(original.get(name), again.get(name)), name
    assert (back / "config.json").read_text() == (source / "config.json").read_text()


def _copy(source, to):
    import shutil

    shutil.copytree(source, to)
    return to


def test_bad_input_is_one_line_naming_the_tensor_or_architecture_and_leaves_nothing(tmp_path):
    import json

    from common.dist_checkpoint import hf_to_dist
    from profiles.errors import UserError

    source = _tiny(tmp_path / "hf", "llama")
    cases = {}
    odd = _copy(source, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    cases[odd] = "architecture MambaForCausalLM has no Megatron conversion"
    wide = _copy(source, tmp_path / "wide")
    (wide / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    cases[wide] = "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], but its config.json makes it [128, 64]"
    lost = _copy(source, tmp_path / "lost")
    (lost / "model.safetensors").rename(lost / "model-00001-of-00001.safetensors")
    index = {"weight_map": {name: "model-00002-of-00002.safetensors" for name in ("model.embed_tokens.weight",)}}
    (lost / "model.safetensors.index.json").write_text(json.dumps(index))
    cases[lost] = ("tensor model.embed_tokens.weight is listed in model.safetensors.index.json in "
                   "model-00002-of-00002.safetensors, which is missing")
    for model, fragment in cases.items():
        with pytest.raises(UserError) as raised:
            hf_to_dist(model, tmp_path / f"{model.name}-dist")
        assert fragment in str(raised.value) and "\n" not in str(raised.value)
        assert not list(tmp_path.glob(f"{model.name}-dist*")), "no partial output is left"
