"""HF <-> megatron-core dist checkpoints (checkpoints/megatron_layout.py and the modules it uses): a
converted model loads into megatron-core's GPTModel (local layer spec, TP=PP=1) with strict key
checking and gives the HF model's logits (dense, MoE with per-expert and grouped-GEMM experts, HF
experts one module each or packed, SmolLM2-135M's real weights); HF -> dist -> HF is bit-exact,
also through megatron-core's own writer, whose `.metadata` the restricted unpickler admits; verl
steps export from either layout. Bad input: tests/e2e/test_converter_bad_input.py.

Nothing here waits on time or measures the machine: under load the file only takes longer. The
logits are compared on fixed tokens (their own generator), not on whatever the global RNG holds
after the tests that ran before."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from grpo_pipeline.checkpoints.dist_writer import cpu_megatron
from grpo_pipeline.checkpoints.hf_shards import HFTensors
from grpo_pipeline.checkpoints.megatron_layout import dist_to_hf, hf_to_dist


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


def gpt_model(config, grouped_experts: bool = False):
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
    spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), qk_layernorm=qk_norm, normalization="RMSNorm",
                                    moe_grouped_gemm=grouped_experts, moe_use_legacy_grouped_gemm=grouped_experts)
    return GPTModel(config=transformer, transformer_layer_spec=spec,
                    vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=config.rope_parameters["rope_theta"],
                    share_embeddings_and_output_weights=config.tie_word_embeddings)


KINDS = ["tiny-qwen3", "smollm2-135m", "qwen2", "llama", "qwen3-moe", "qwen3-moe-packed"]


def _source(kind, request, tmp_path):
    """The HF directory of a model kind: the built-in tiny and SmolLM2 store entries, or a tiny random one."""
    if kind == "tiny-qwen3":
        return request.getfixturevalue("tiny_model_dir")
    if kind == "smollm2-135m":
        return request.getfixturevalue("smollm2_dir")
    return _tiny(tmp_path / "hf", kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_converted_model_loads_strictly_and_gives_the_hf_logits(megatron_cpu, request, tmp_path, kind):
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    source = _source(kind, request, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    out = hf_to_dist(source, tmp_path / "dist")
    assert not list(tmp_path.glob("dist.partial-*"))  # the staging folder was renamed into place
    model = gpt_model(hf.config).eval()
    with cpu_megatron():
        state = dist_checkpointing.load(model.sharded_state_dict(), str(out), strict="raise_all")
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]  # the default is built on CUDA
    with torch.no_grad(), cpu_megatron():
        logits = model(tokens, torch.arange(12)[None].expand(2, -1), mask)
        reference = hf(tokens).logits
    # fp32: only the two implementations' summation orders differ, which grows with depth and the
    # logits' size (SmolLM2's 30 layers, logits near 20: 6e-5 seen)
    difference = (logits - reference).abs().max().item()
    assert difference <= 1e-5 * max(1.0, reference.abs().max().item()), difference


@pytest.mark.parametrize("kind", ["qwen2", "qwen3-moe"])
def test_what_megatron_core_itself_saves_exports_to_the_original_hf_weights(megatron_cpu, request, tmp_path, kind):
    """The export reads checkpoints megatron-core's own writer made (as verl saves a step), not only
    this converter's: a model loaded from the conversion, saved by `dist_checkpointing.save`, comes
    back to HF bit for bit."""
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    source = _source(kind, request, tmp_path)
    model = gpt_model(AutoConfig.from_pretrained(source))
    with cpu_megatron():
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(hf_to_dist(source, tmp_path / "dist")),
                                                      strict="raise_all"))
        (tmp_path / "saved").mkdir()
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "saved"))
    back = dist_to_hf(tmp_path / "saved", source, tmp_path / "back")
    original, again = HFTensors(source), HFTensors(back)
    assert set(original.where) == set(again.where)
    assert all(torch.equal(original.get(name), again.get(name)) for name in original.where)


def test_the_metadata_unpickler_admits_every_class_megatron_core_and_this_converter_pickle(megatron_cpu, tmp_path):
    """`.metadata` is a pickle; `MetadataUnpickler` builds only the classes it admits. Every class
    that megatron-core 0.16's own `dist_checkpointing.save` and this converter's writer put into one
    (listed by unpickling the real files, dense and MoE) is admitted, so no real checkpoint is refused;
    the crafted one is refused (tests/e2e/test_converter_bad_input.py)."""
    import pickle

    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from grpo_pipeline.checkpoints.dist_reader import MetadataUnpickler, load_metadata

    class Listing(pickle.Unpickler):
        def find_class(self, module, name):
            pickled.add((module, name))
            return super().find_class(module, name)

    pickled: set[tuple[str, str]] = set()
    for kind in ("qwen2", "qwen3-moe"):
        source = _tiny(tmp_path / "hf", kind)
        converted, saved = hf_to_dist(source, tmp_path / f"{kind}-dist"), tmp_path / f"{kind}-saved"
        model = gpt_model(AutoConfig.from_pretrained(source))
        with cpu_megatron():
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(converted), strict="raise_all"))
            saved.mkdir()
            dist_checkpointing.save(model.sharded_state_dict(), str(saved))
        for checkpoint in (converted, saved):
            with open(checkpoint / ".metadata", "rb") as handle:
                Listing(handle).load()
            load_metadata(checkpoint / ".metadata")
    assert ("torch.distributed.checkpoint.planner", "SavePlan") in pickled  # megatron-core's own, not only ours
    refuser = MetadataUnpickler(io.BytesIO(b""))
    for module, name in sorted(pickled):
        refuser.find_class(module, name)  # raises for a class it does not admit


def _gmm(inputs, weights, tokens_per_expert, trans_b=False):
    """The grouped GEMM of the `grouped_gemm` package (a CUDA kernel), in torch: the rows of each
    expert's tokens times that expert's [in, out] weight."""
    rows = inputs.split(tokens_per_expert.tolist())
    return torch.cat([part @ (w.T if trans_b else w) for part, w in zip(rows, weights)])


def test_one_moe_checkpoint_serves_grouped_gemm_and_per_expert_experts(megatron_cpu, tmp_path, monkeypatch):
    """megatron-core 0.16 writes grouped-GEMM experts (GroupedMLP, TEGroupedMLP) under the same keys
    and shapes as per-expert ones (SequentialMLP): [layer, expert, ...] with per-expert
    `_extra_state`. The converted checkpoint loads strictly into a grouped-GEMM model, its weights
    land transposed in `weight1` / `weight2` as GroupedMLP keeps them, and the logits are HF's. The
    `grouped_gemm` CUDA kernel is stood in by torch (`_gmm`): there is no CPU build of it."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.moe import experts, grouped_gemm_util
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm_is_available", lambda: True)
    monkeypatch.setattr(experts.gg, "ops", type("ops", (), {"gmm": staticmethod(_gmm)}), raising=False)
    source = _tiny(tmp_path / "hf", "qwen3-moe")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    out = hf_to_dist(source, tmp_path / "dist")
    model = gpt_model(hf.config, grouped_experts=True).eval()
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
    with cpu_megatron():
        state = dist_checkpointing.load(model.sharded_state_dict(), str(out), strict="raise_all")
    model.load_state_dict(state, strict=True)
    config = hf.config
    grouped = model.decoder.layers[1].mlp.experts
    fc1 = grouped.weight1.view(config.num_experts, config.hidden_size, -1)
    fc2 = grouped.weight2.view(config.num_experts, -1, config.hidden_size)
    for e in range(config.num_experts):
        expert = {k: v for k, v in hf.state_dict().items() if k.startswith("model.layers.1.mlp.experts.")}
        gate_up = expert.get("model.layers.1.mlp.experts.gate_up_proj")
        if gate_up is None:  # transformers keeps per-expert modules
            gate_up = torch.cat([expert[f"model.layers.1.mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up")])[None]
        assert torch.equal(fc1[e].T, gate_up[0 if gate_up.shape[0] == 1 else e])
        down = expert.get("model.layers.1.mlp.experts.down_proj")
        down = down[e] if down is not None else expert[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(fc2[e].T, down)
    model.config.bf16 = True  # GroupedMLP asserts bf16 (its kernel's only dtype); torch's matmul takes fp32
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), cpu_megatron():
        logits = model(tokens, torch.arange(12)[None].expand(2, -1), mask)
        assert torch.allclose(logits, hf(tokens).logits, atol=1e-5, rtol=0)


def _tiny(tmp_path, kind: str):
    """A tiny random model of an architecture family, saved as HF safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "qwen3-moe-packed":
        return _packed(_tiny(tmp_path, "qwen3-moe"), tmp_path / kind)
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


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_dist_to_hf_is_bit_exact(request, tmp_path, kind):

    source = _source(kind, request, tmp_path)
    back = dist_to_hf(hf_to_dist(source, tmp_path / "dist"), source, tmp_path / "back")
    original, again = HFTensors(source), HFTensors(back)
    assert set(original.where) == set(again.where)
    for name in original.where:
        assert torch.equal(original.get(name), again.get(name)), name
    assert (back / "config.json").read_text() == (source / "config.json").read_text()


def _packed(source, to):
    """The MoE model with its experts packed per layer (`mlp.experts.gate_up_proj` [E, 2F, H],
    `mlp.experts.down_proj` [E, H, F]), the layout of checkpoints such as Qwen3.5's."""
    import re

    from safetensors.torch import load_file, save_file

    tensors, experts = load_file(source / "model.safetensors"), {}
    for name in list(tensors):
        found = re.match(r"(.*mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
        if found:
            experts.setdefault(found[1], {}).setdefault(found[3], {})[int(found[2])] = tensors.pop(name)
    for prefix, parts in experts.items():
        count = len(parts["gate"])
        tensors[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(count)])
        tensors[prefix + ".down_proj"] = torch.stack([parts["down"][e] for e in range(count)])
    shutil.copytree(source, to, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_a_verl_step_exports_from_either_layout_and_is_scored(tiny_model_dir, tmp_path):
    """verl's layout v2: HF weights in actor/model/huggingface (the bridge's), or a dist checkpoint in
    actor/model/dist_ckpt with only the config and tokenizer in huggingface/. Both export to a
    verified HF directory of the same weights, which the evaluation stage scores alike."""
    from grpo_pipeline.backends.base import TrainResult
    from grpo_pipeline.profiles.schema import DataSection
    from grpo_pipeline.stages.dataset import DataSpec, fetch_dataset
    from grpo_pipeline.stages.evaluate import EvalSettings, evaluate
    from grpo_pipeline.stages.export import export_checkpoint

    steps = {}
    for layout in ("huggingface", "dist_ckpt"):
        model = tmp_path / layout / "global_step_4" / "actor" / "model"
        shutil.copytree(tiny_model_dir, model / "huggingface", ignore=shutil.ignore_patterns(
            "manifest.json", *(["*.safetensors"] if layout == "dist_ckpt" else [])))
        if layout == "dist_ckpt":
            hf_to_dist(tiny_model_dir, model / "dist_ckpt")
        steps[layout] = model.parents[1]
    policies = {layout: export_checkpoint(TrainResult(backend="verl", checkpoint_dir=str(step), steps_done=4,
                                                      max_steps=4, metrics_file=""))
                for layout, step in steps.items()}
    assert policies["huggingface"].path == str(steps["huggingface"] / "actor" / "model" / "huggingface")
    assert policies["dist_ckpt"].path == str(steps["dist_ckpt"] / "actor" / "huggingface-export")
    assert policies["dist_ckpt"].num_parameters == policies["huggingface"].num_parameters
    # a second export finds the converted directory
    assert export_checkpoint(TrainResult(backend="verl", checkpoint_dir=str(steps["dist_ckpt"]), steps_done=4,
                                         max_steps=4, metrics_file="")).path == policies["dist_ckpt"].path

    data = fetch_dataset(DataSpec.from_profile(DataSection(root=str(tmp_path / "data"))))
    report = evaluate({layout: Path(p.path) for layout, p in policies.items()}, Path(data.val_files[0]),
                      EvalSettings(max_prompts=8, max_new_tokens=8), tmp_path / "eval")
    hf, dist = report.models
    assert (hf.prompts, dist.prompts) == (8, 8)
    assert Path(hf.samples_file).read_text() == Path(dist.samples_file).read_text()


def test_a_step_without_a_policy_is_one_line_naming_what_is_missing(tmp_path):
    from grpo_pipeline.backends.verl.checkpoint import verl_hf_dir
    from grpo_pipeline.errors import UserError

    (tmp_path / "global_step_2" / "actor" / "model" / "huggingface").mkdir(parents=True)
    with pytest.raises(UserError, match="no policy to export: neither HF weights in actor/model/huggingface or "
                                        "actor/huggingface nor a complete dist checkpoint in actor/model/dist_ckpt"):
        verl_hf_dir(tmp_path / "global_step_2")
