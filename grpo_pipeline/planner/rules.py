"""The layout rules of a verl run, checked before anything expensive starts: what Megatron, vLLM and
verl 0.9.1 would reject half an hour into a cluster start.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --set engine.tp=3 --dry-run   # refused, exit 2

The parallel layout against the world size and the model's shape (pipeline stages as megatron-core
0.16 splits them), the rollout layout against a node, and the batch sizes against the data-parallel
ranks. A backend picks the rules that apply to it (`Backend.profile_problems`); the layout search
(planner/layouts.py) runs them on every candidate. Each message names the field, its value and a fix.
"""

from __future__ import annotations

from math import gcd, isqrt
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, found up to its square root: a world of 4M devices (the bounds' largest)
    is planned in every candidate layout of the search."""
    low = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return sorted({*low, *(n // d for d in low)})


def _divisors(n: int) -> str:
    return ", ".join(map(str, divisors(n)))


# megatron-core's TransformerConfig fields for uneven pipeline stages: first-class engine settings here.
UNEVEN_PIPELINE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def pipeline_split(num_layers: int, pp: int, vpp: int | None, first: int | None = None, last: int | None = None,
                   embedding: bool = False, loss: bool = False) -> tuple[list[int], list[str]]:
    """Decoder layers of each pipeline stage, as megatron-core 0.16 assigns them
    (TransformerConfig.__post_init__, transformer_block.py), or the rules the split breaks."""
    chunks = vpp or 1
    if (first or last) and (embedding or loss):
        return [], ["the first/last stage layer counts cannot be combined with "
                    "account_for_embedding/loss_in_pipeline_split; use one or the other"]
    if first or last:
        given = [n for n in (first, last) if n]
        if pp == 1:
            return [], ["uneven first/last pipeline stages need engine.pp > 1"]
        if any(n % chunks for n in given):
            return [], [f"the first/last stage layer counts must divide by engine.vpp={chunks}"]
        middle_layers, middle_stages = num_layers - sum(given), pp - len(given)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and (middle_layers % middle_stages or (middle_layers // middle_stages) % chunks)):
            return [], [f"the {num_layers} layers less the first/last stages' {' + '.join(map(str, given))} leave "
                        f"{middle_layers} for {middle_stages} middle stage(s), not an even split"
                        + (f" in multiples of engine.vpp={chunks}" if chunks > 1 else "")]
        middle = middle_layers // middle_stages if middle_stages else 0
        return [first or middle] + [middle] * (pp - 2) + [last or middle], []
    units = num_layers + embedding + loss
    if units % pp or (units // pp) % chunks:
        return [], []  # the caller names the even-split problem
    split = [units // pp] * pp
    split[0] -= embedding
    split[-1] -= loss
    return split, []


def uneven_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """First and last stage layer counts whose split's fullest stage is the smallest megatron-core
    allows (94 over 8: 11 + 6 x 12 + 11; 61 over 12: 5 + 10 x 5 + 6), or None when none exists."""
    if pp < 2 or num_layers < pp:
        return None
    if pp == 2:
        return num_layers // 2, num_layers - num_layers // 2
    splits = []
    for middle in range(1, num_layers // (pp - 2) + 1):
        edges = num_layers - (pp - 2) * middle
        if edges >= 2:
            splits.append((max(middle, edges - edges // 2), -middle, (edges // 2, edges - edges // 2)))
    return min(splits)[2] if splits else None


def layout_problems(p: RunProfile) -> list[str]:
    """Megatron's parallel layout against the world and the model (verl backend only)."""
    e, arch, world = p.engine, p.model.architecture, p.world_size
    problems = []
    model_parallel = e.tp * e.pp * e.cp
    heads = {field: n for field, n in (("attention", arch.num_attention_heads), ("kv", arch.num_kv_heads),
                                       ("linear key", arch.linear_num_key_heads),
                                       ("linear value", arch.linear_num_value_heads)) if n is not None}
    if undivided := {field: n for field, n in heads.items() if n % e.tp}:
        # One problem and one fix for TP, whatever number of head counts it misses: the TPs that split
        # every head count and leave PP x CP a divisor of the world.
        fitting = [tp for tp in divisors(gcd(*heads.values())) if world % (tp * e.pp * e.cp) == 0]
        problems.append(
            f"engine.tp={e.tp}: the model's heads ({', '.join(f'{field} {n}' for field, n in undivided.items())}) do "
            f"not split {e.tp} ways; use engine.tp in {', '.join(map(str, fitting)) or 'none of 1..' + str(world)}")
    if world % model_parallel:
        problems.append(
            f"engine.tp={e.tp}, engine.pp={e.pp}, engine.cp={e.cp}: TP x PP x CP = {model_parallel} does not "
            f"divide the world size {world} (cluster.nnodes {p.cluster.nnodes} x cluster.devices_per_node "
            f"{p.cluster.devices_per_node}); pick values whose product is one of {_divisors(world)}"
        )
    problems += pipeline_problems(p)
    if e.mtp and not arch.mtp_layers:
        problems.append("engine.mtp=true: the model has no multi-token-prediction layers "
                        "(model.architecture.mtp_layers is 0); set engine.mtp=false")
    if arch.num_experts == 0 and e.ep * e.etp > 1:
        problems.append(
            f"engine.ep={e.ep}, engine.etp={e.etp}: the model is dense (no experts); set engine.ep=1 engine.etp=1"
        )
    elif arch.num_experts and arch.num_experts % e.ep:
        problems.append(
            f"engine.ep={e.ep}: {arch.num_experts} experts do not split evenly over EP ranks; "
            f"use an EP in {_divisors(arch.num_experts)}"
        )
    ranks_per_stage = world // e.pp if world % e.pp == 0 else None
    if arch.num_experts and (ranks_per_stage is None or ranks_per_stage % (e.ep * e.etp)):
        problems.append(
            f"engine.ep={e.ep}, engine.etp={e.etp}: EP x ETP = {e.ep * e.etp} must divide the ranks of one "
            f"pipeline stage, TP x CP x DP = {world} / PP {e.pp}; lower engine.ep or engine.etp"
        )
    return problems


def pipeline_problems(p: RunProfile) -> list[str]:
    """The layers over the pipeline stages (megatron-core 0.16's rules, uneven stages included)."""
    e, layers = p.engine, p.model.architecture.num_layers
    problems = [f"engine.transformer_overrides.{name}: set engine.{name} instead (validation, the memory plan and "
                "both roles read it there)" for name in UNEVEN_PIPELINE_FIELDS if name in e.transformer_overrides]
    if e.vpp is not None and e.pp == 1:
        return problems + [f"engine.vpp={e.vpp}: virtual pipeline stages need engine.pp > 1; set engine.vpp=null"]
    first, last = e.num_layers_in_first_pipeline_stage, e.num_layers_in_last_pipeline_stage
    embedding, loss = e.account_for_embedding_in_pipeline_split, e.account_for_loss_in_pipeline_split
    split, broken = pipeline_split(layers, e.pp, e.vpp, first, last, embedding, loss)
    if broken:
        named = ", ".join(f"engine.{name}={getattr(e, name)}" for name in UNEVEN_PIPELINE_FIELDS if getattr(e, name))
        return problems + [f"engine.pp={e.pp}, {named}: {problem}" for problem in broken]
    if split:
        return problems
    units = layers + embedding + loss
    counted = f"{layers} layers" + (" + the embedding" if embedding else "") + (" + the loss" if loss else "")
    if e.vpp is not None and units % e.pp == 0:
        return problems + [f"engine.vpp={e.vpp}: {counted} do not split into PP x VPP = {e.pp * e.vpp} chunks; "
                           f"use PP x VPP in {_divisors(units)}"]
    hint = ""
    if (edges := uneven_split(layers, e.pp)) and not (embedding or loss):
        hint = (f" or an uneven split\nan uneven split of {layers} layers over {e.pp} stages: --set "
                f"engine.num_layers_in_first_pipeline_stage={edges[0]} --set "
                f"engine.num_layers_in_last_pipeline_stage={edges[1]}")
    return problems + [f"engine.pp={e.pp}: the model's {counted} do not split evenly over {e.pp} stages; "
                       f"use a PP in {_divisors(units)}{hint}"]


def rollout_problems(p: RunProfile) -> list[str]:
    """vLLM's tensor-parallel layout (verl backend only)."""
    r, arch, per_node = p.rollout, p.model.architecture, p.cluster.devices_per_node
    problems = []
    # verl 0.9.1 spans an engine over whole nodes when its TP is larger than a node (RolloutReplica).
    spans_nodes = r.tp > per_node and r.tp % per_node == 0 and p.world_size % r.tp == 0
    if (r.tp > per_node or per_node % r.tp) and not spans_nodes:
        problems.append(
            f"rollout.tp={r.tp}: an engine spans part of a node ({per_node} devices) or whole nodes of the "
            f"world's {p.world_size}; use a rollout TP in {_divisors(per_node)}, or a multiple of {per_node} that "
            f"divides {p.world_size}"
        )
    if arch.num_attention_heads % r.tp:
        problems.append(
            f"rollout.tp={r.tp}: vLLM needs the {arch.num_attention_heads} attention heads to divide by the "
            f"rollout TP; use one of {_divisors(arch.num_attention_heads)}"
        )
    kv = arch.num_kv_heads
    if kv % r.tp and r.tp % kv:
        problems.append(
            f"rollout.tp={r.tp}: vLLM needs the {kv} KV heads to divide by the rollout TP or the rollout TP "
            f"to be a multiple of them"
        )
    return problems


def batch_problems(p: RunProfile, data_parallel: int) -> list[str]:
    """Batch sizes against the data-parallel ranks, as verl 0.9.1 checks them."""
    d, a, n = p.data, p.actor, p.algorithm.rollout_n
    problems = []
    if d.train_batch_size < a.ppo_mini_batch_size or d.train_batch_size % a.ppo_mini_batch_size:
        problems.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}: must divide data.train_batch_size="
            f"{d.train_batch_size} (each step makes whole optimizer updates); use one of {_divisors(d.train_batch_size)}"
        )
    if not a.use_dynamic_bsz and data_parallel > 0:
        per_micro_round = data_parallel * a.ppo_micro_batch_size_per_gpu
        for field, prompts, sequences in (
            ("data.train_batch_size", d.train_batch_size, p.sequences_per_step),
            ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, p.sequences_per_update),
        ):
            if sequences % per_micro_round:
                problems.append(
                    f"{field}={prompts}: {prompts} prompts x rollout_n {n} = {sequences} sequences do not split over "
                    f"{data_parallel} ranks x micro batch {a.ppo_micro_batch_size_per_gpu}; make {field} x rollout_n "
                    f"a multiple of {per_micro_round}"
                )
    return problems


def fsdp_problems(p: RunProfile) -> list[str]:
    """FSDP2's layout as verl 0.9.1 builds it (a Megatron setting never reaches it: the profile's engine
    section refuses one, profiles/engine.py). The Ulysses rules, each verl's own (tests/test_verl_fsdp_rules.py finds each check in verl's source): the (dp, sp)
    device mesh (workers/engine/fsdp/transformer_impl.py `_init_device_mesh`), attention and KV heads
    over the Ulysses ranks (models/transformers/monkey_patch.py `apply_monkey_patch`'s asserts), packed
    sequences (transformer_impl.py, workers/config/actor.py), and the batch over every device
    (utils/config.py `validate_config`)."""
    e, arch, world = p.engine, p.model.architecture, p.world_size
    problems = []
    if e.fsdp_size == 0 or (0 < e.fsdp_size < world and world % e.fsdp_size):
        problems.append(f"engine.fsdp_size={e.fsdp_size}: an FSDP group must divide the world size {world} (verl "
                        f"builds a (world / fsdp_size, fsdp_size) device mesh); use -1 or one of {_divisors(world)}")
    sp = e.ulysses_sp
    if world % sp:
        problems.append(f"engine.ulysses_sp={sp}: must divide the world size {world}; use one of {_divisors(world)}")
    if arch.num_attention_heads % sp:
        problems.append(f"engine.ulysses_sp={sp}: Ulysses splits the {arch.num_attention_heads} attention heads over "
                        f"its ranks; use one of {_divisors(arch.num_attention_heads)}")
    kv = arch.num_kv_heads
    if kv % sp and sp % kv:
        fits = [size for size in range(1, world + 1) if not world % size and not arch.num_attention_heads % size
                and (not kv % size or not size % kv)]
        problems.append(f"engine.ulysses_sp={sp}: Ulysses splits the {kv} KV heads over its ranks, or repeats them when "
                        f"its size is a multiple of them (verl asserts num_key_value_heads % sp == 0 or sp % "
                        f"num_key_value_heads == 0 when it builds the model); use one of {', '.join(map(str, fits))}")
    if sp > 1 and e.attn_implementation != "flash_attention_2":
        problems.append(f"engine.ulysses_sp={sp}: verl's Ulysses patches transformers' FlashAttention 2 path only "
                        f"(with {e.attn_implementation} each rank would attend to its own slice); set "
                        "engine.attn_implementation=flash_attention_2 (flash-attn on every node) or engine.ulysses_sp=1")
    if sp > 1 and not e.use_remove_padding:
        problems.append(f"engine.ulysses_sp={sp}: Ulysses sequence parallelism needs packed sequences; set "
                        "engine.use_remove_padding=true (verl refuses it otherwise)")
    sequences = p.sequences_per_step
    if sp > 1 and not p.actor.use_dynamic_bsz and sequences % world:  # verl's validate_config, beside batch_problems
        problems.append(f"data.train_batch_size={p.data.train_batch_size}: {p.data.train_batch_size} prompts x rollout_n "
                        f"{p.algorithm.rollout_n} = "
                        f"{sequences} sequences must divide over the world's {world} devices (verl's FSDP check); "
                        f"make data.train_batch_size x rollout_n a multiple of {world}")
    if p.model.dist_checkpoint:
        problems.append("model.dist_checkpoint=true: a Megatron dist checkpoint is for engine.strategy=megatron; FSDP "
                        "loads the Hugging Face weights; set model.dist_checkpoint=false")
    return problems
