"""The typed description of a GRPO run: `RunProfile` and its sections.

Every field has a type, a default and a description written for the person filling in the Prefect
form; every section is a `Section` (profiles/section.py: unknown keys rejected). The device table is
`Platform` (profiles/platform.py). Rules that involve several fields live in `profiles/validation.py`
and with each backend; how the layers are merged lives in `profiles/loader.py`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from grpo_pipeline.profiles.backend_table import BACKEND_TABLE, BackendName
from grpo_pipeline.profiles.datasets import DataColumns, DatasetName
from grpo_pipeline.profiles.evaluation import EvalSection
from grpo_pipeline.profiles.engine import EngineSection, GenerationSection, LogProbSection, MegatronEngine, RolloutSection
from grpo_pipeline.profiles.guards import GuardsSection
from grpo_pipeline.profiles.lora import LoraSection
from grpo_pipeline.profiles.platform import DeviceKind, Platform
from grpo_pipeline.profiles.requirements import NodeRequirement
from grpo_pipeline.profiles.rewards import RewardSection
from grpo_pipeline.profiles.section import (
    MAX_DEVICES_PER_NODE, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_NODES, MAX_SEQUENCES, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH,
    Section,
)
from grpo_pipeline.profiles.tracking import TrackingSection

__all__ = ["DeviceKind", "Platform", "RunProfile", "Section"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ProxyPolicy = Literal["clear", "bypass-cluster", "keep"]


class ModelArchitecture(Section):
    """The numbers of the model that decide which parallel layouts are possible."""

    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="Decoder layers (`num_hidden_layers`).")
    num_attention_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Query heads of full attention.")
    num_kv_heads: int = Field(..., gt=0, le=MAX_HEADS, description="Key/value heads (`num_key_value_heads`).")
    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="Routed experts per MoE layer; 0 for a dense model.")
    hidden_size: int = Field(..., gt=0, le=MAX_WIDTH, description="Hidden size of the decoder.")
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="Vocabulary size.")
    linear_num_key_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS, description="Key heads of the linear-attention (Gated DeltaNet) layers, if any."
    )
    linear_num_value_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS, description="Value heads of the linear-attention (Gated DeltaNet) layers, if any."
    )
    # The numbers below size the model (parameters, memory: profiles/model_size.py, planner/memory.py);
    # a model directory's config.json gives them, a recipe records them.
    head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Width of one attention head; empty: hidden_size / num_attention_heads.")
    intermediate_size: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Width of a dense MLP (dense models).")
    moe_intermediate_size: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Width of one routed expert's MLP.")
    shared_expert_intermediate_size: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Width of the shared expert of each MoE layer, if any.")
    num_experts_per_tok: int | None = Field(None, gt=0, le=MAX_EXPERTS, description="Experts each token is routed to (top-k).")
    tie_word_embeddings: bool = Field(False, description="The output layer shares the input embedding's weights.")
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys per head (Qwen3 and later).")
    attention_bias: bool = Field(False, description="Bias on the query, key and value projections (Qwen2).")
    attention_output_gate: bool = Field(
        False, description="A sigmoid gate on the attention output, projected with the queries (Qwen3.5).")
    full_attention_interval: int | None = Field(
        None, gt=0, le=MAX_LAYERS, description="Hybrid models: every N-th layer is full attention, the others linear attention.")
    linear_key_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Key head width of the linear-attention layers.")
    linear_value_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Value head width of the linear-attention layers.")
    linear_conv_kernel_dim: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Width of the linear-attention layers' short convolution.")
    model_type: str | None = Field(
        None, max_length=64, description="The checkpoint's `model_type` (config.json): which family's size model "
        "applies; the planner sizes llama, qwen2, qwen3, qwen3_moe, qwen3_next, qwen3_5(_moe), deepseek_v3, kimi_k2 "
        "and glm4_moe and estimates no other. Empty: a Llama/Qwen-style decoder as the numbers here describe.")
    hf_architecture: str | None = Field(
        None, max_length=128, description="The checkpoint's class (config.json's `architectures[0]`, e.g. "
        "`Qwen3_5MoeForConditionalGeneration`): what NVIDIA Megatron-Bridge looks its bridge up by (mbridge uses "
        "`model_type`); the preflight checks each node's bridge knows it.")
    first_k_dense_replace: int = Field(
        0, ge=0, le=MAX_LAYERS, description="MoE models: the first N layers have a dense MLP of `intermediate_size` "
        "instead of experts (DeepSeek-V3, GLM-4.5).")
    q_lora_rank: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Multi-latent attention (DeepSeek-V3): rank of the query compression; "
        "empty: queries are projected directly.")
    kv_lora_rank: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Multi-latent attention: rank of the key/value latent (what its KV cache holds).")
    qk_nope_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Multi-latent attention: query/key head width without rotary.")
    qk_rope_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Multi-latent attention: query/key head width with rotary.")
    v_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Multi-latent attention: value head width.")
    mtp_layers: int = Field(
        0, ge=0, le=MAX_LAYERS, description="Multi-token-prediction layers the checkpoint holds (`num_nextn_predict_layers`, "
        "`mtp_num_hidden_layers`); trained and held only with `engine.mtp`.")
    max_position_embeddings: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="Longest sequence the model's positions cover (config.json); a prompt "
        "and its response must fit. Empty: not checked against the model.")
    vision_parameters: int = Field(
        0, ge=0, le=MAX_WIDTH**2, description="Parameters of the vision tower a multimodal checkpoint holds (Qwen3.5: "
        "counted from config.json's vision_config); verl builds it with the language model.")


class ModelSection(Section):
    name: str = Field("custom", description="Recipe name, or `custom` for a model given by path.")
    path: str = Field(
        ...,
        description="Hugging Face repo id (e.g. `Qwen/Qwen3.5-122B-A10B`), a local HF directory, or "
        "`builtin:<name>` for a model the pipeline builds itself.",
    )
    revision: str = Field("main", description="Hub revision (branch, tag or commit) to pin.")
    root: str = Field(
        "~/models",
        description="Directory (shared by all nodes on a cluster) that holds downloaded and built models.",
    )
    files: list[str] = Field(
        ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        description="Patterns of the repo files to download: config, tokenizer and safetensors weights.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code shipped with the checkpoint.")
    enable_gradient_checkpointing: bool = Field(
        True, description="Recompute activations in the backward pass to save memory. Unless a recipe, a profile "
        "file or --set says, the local backend turns it off on a host whose GPUs or NPUs have room for the training "
        "step without it (backends/local/train_memory.py; the dry run says which and why)."
    )
    dist_checkpoint: bool = Field(
        False,
        description="Also convert the base model, once, into a megatron-core dist checkpoint in `model.root`, "
        "and have verl's Megatron ranks each load their shard of it (`use_dist_checkpointing`) instead of "
        "all reading the HF safetensors through the bridge. Llama, Qwen2, Qwen3 and Qwen3-MoE; not Qwen3.5.",
    )
    architecture: ModelArchitecture = Field(
        ..., description="Architecture numbers used to validate the parallel layout."
    )


class ClusterSection(Section):
    nnodes: int = Field(1, gt=0, le=MAX_NODES, description="Number of machines in the run.")
    devices_per_node: int = Field(
        1, gt=0, le=MAX_DEVICES_PER_NODE, description="Accelerators per machine (on CPU: training worker processes)."
    )
    ready_timeout_s: int = Field(
        900, gt=0,
        description="verl backend: how long the train stage waits for `nnodes` alive Ray nodes offering "
        "`devices_per_node` devices each (nodes still joining) before it gives up, naming what is missing.",
    )
    preflight_timeout_s: int = Field(
        120, gt=0,
        description="verl backend: how long each node has to answer the preflight (what its image has: a Ray task "
        "that reads package metadata and imports what the run needs, in a child process) before it is named as "
        "not answering and the run is refused.",
    )


class DataSection(Section):
    dataset: DatasetName = Field(
        "arith",
        description="Dataset, which also picks the converter and the reward: `arith` (generated, no network), "
        "`gsm8k`, `geo3k`, `math` (MATH, 7.5k training problems), `math500`, `dapo17k` (DAPO-Math-17k), `aime24`, "
        "`aime25`, or `mapped`: any hub or local dataset by `data.columns` (profiles/datasets.py).",
    )
    columns: DataColumns = Field(default_factory=DataColumns, description="`data.dataset=mapped`: the columns that "
                                 "make the prompt and the answer.")
    source: str | None = Field(
        None,
        description="Hub dataset repo id (e.g. `tyzhu/geo3k`) or a local directory of parquet files; "
        "empty for the dataset's default (`openai/gsm8k`, `hiyouga/geometry3k`, the arith generator).",
    )
    revision: str = Field("main", description="Hub revision of the dataset to pin (a commit is best).")
    files: list[str] | None = Field(
        None,
        description="Patterns of the parquet files to fetch, e.g. `[main/*.parquet]`; empty for the "
        "dataset's default. Splits are told apart by file name (train / test / validation).",
    )
    root: str = Field(
        "~/data", description="Directory (shared by all nodes on a cluster) that holds datasets."
    )
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the arith generator, the data order and training "
                      "(numpy and torch take 0 to 2**32 - 1; a negative one failed after generation, and was retried).")
    arith_train_rows: int = Field(1024, gt=0, le=MAX_SEQUENCES, description="Training problems the arith generator makes.")
    arith_test_rows: int = Field(128, gt=0, le=MAX_SEQUENCES, description="Held-out problems the arith generator makes.")
    train_batch_size: int = Field(8, gt=0, le=MAX_SEQUENCES, description="Prompts per training step.")
    max_prompt_length: int = Field(256, gt=0, le=MAX_TOKENS, description="Longest prompt in tokens.")
    max_response_length: int = Field(256, gt=0, le=MAX_TOKENS, description="Longest generated response in tokens.")
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error", description="What to do with a prompt longer than `max_prompt_length`."
    )
    filter_overlong_prompts: bool = Field(
        False, description="Drop prompts longer than `max_prompt_length` before training."
    )
    filter_overlong_prompts_workers: int = Field(
        1, gt=0, description="Processes used to filter over-long prompts."
    )


class AlgorithmSection(Section):
    """One algorithm description that drives both backends (verl keys in parentheses)."""

    adv_estimator: Literal["grpo"] = Field("grpo", description="Advantage estimator.")
    rollout_n: int = Field(
        4, gt=0, le=MAX_HEADS, description="Group size: responses sampled per prompt (`rollout.n`)."
    )
    use_kl_in_reward: bool = Field(False, description="Subtract a KL penalty from the reward.")
    use_kl_loss: bool = Field(
        False, description="Add a KL loss against the reference model (builds a reference model)."
    )
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss.")
    kl_loss_type: str = Field("low_var_kl", description="KL estimator for the KL loss.")
    entropy_coeff: float = Field(0.0, description="Weight of the entropy bonus.")
    lr: float = Field(1e-6, gt=0, description="Actor learning rate.")
    clip_ratio_low: float = Field(0.2, ge=0, description="Lower PPO clip ratio.")
    clip_ratio_high: float = Field(0.2, ge=0, description="Upper PPO clip ratio.")
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="How per-token losses are aggregated.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts.")


class ActorSection(Section):
    ppo_mini_batch_size: int = Field(
        8, gt=0, le=MAX_SEQUENCES, description="Prompts per optimizer step (each with `rollout_n` responses)."
    )
    ppo_micro_batch_size_per_gpu: int = Field(
        1, gt=0, le=MAX_SEQUENCES, description="Sequences per device per forward/backward pass."
    )
    ppo_max_token_len_per_gpu: int = Field(
        8192, gt=0, le=MAX_TOKENS, description="Token budget per device when dynamic batch size is on."
    )
    use_dynamic_bsz: bool = Field(False, description="Pack micro batches by token count.")
    use_torch_compile: bool = Field(True, description="Compile the actor's hot functions.")
    checkpoint_save_contents: list[str] = Field(
        ["model", "extra", "optimizer"], description="What each checkpoint holds."
    )
    checkpoint_strict: bool = Field(
        True, description="Fail when a checkpoint does not match the model exactly."
    )


class TrainerSection(Section):
    project_name: str = Field("grpo-pipeline", description="Experiment-tracker project.")
    experiment_name: str = Field("grpo", description="Experiment-tracker run name.")
    logger: list[str] = Field(["console"], description="Where metrics go (`console`, `wandb`...).")
    total_epochs: int = Field(1, gt=0, description="Passes over the training data.")
    total_training_steps: int | None = Field(
        None, gt=0, le=MAX_SEQUENCES, description="Stop after this many steps (null: run all epochs)."
    )
    save_freq: int = Field(10, description="Checkpoint every N steps (-1: never).")
    test_freq: int = Field(10, description="Validate every N steps (-1: never).")
    val_before_train: bool = Field(False, description="Validate once before the first step.")
    resume_mode: Literal["auto", "disable"] = Field(
        "auto", description="`auto` resumes from the latest checkpoint of this run."
    )
    step_timeout_s: int = Field(
        3600, gt=0,
        description="A step (the first includes loading the model) that takes longer is taken for a hang: the "
        "workers (local) or the Ray job (verl) are stopped and the train stage's retry resumes from the latest "
        "checkpoint.",
    )
    entrypoint: str = Field(
        "python3 -m verl.trainer.main_ppo",
        description="verl backend: the command the Ray job runs before the Hydra overrides (shell words). "
        "verl's own trainer by default; a patched trainer module, or the tests' stand-in "
        "(`python tests/verl_stand_in.py`), goes here.",
    )


class PlannerSection(Section):
    """The memory planner (planner/memory.py): whether it may refuse a layout, and what it assumes of
    the image the run uses."""

    enforce: bool = Field(
        True, description="Refuse, at planning, a layout the memory plan says cannot fit. false: plan, log the "
        "refusal as a warning (dry run, its JSON, the run's report) and start anyway: for a layout known to run "
        "(a published recipe) that the estimate does not model well.")
    layer_spec: Literal["transformer_engine", "local"] = Field(
        "transformer_engine", description="megatron-core layers the image builds, which decide what activations "
        "the backward pass keeps: `transformer_engine` (verl's GPU images; MindSpeed on NPU fuses alike: grouped "
        "GEMM experts, fused SwiGLU and permutation) or `local` (megatron-core's plain PyTorch layers, as the H200 "
        "calibration probe builds them).")
    adam: Literal["fused", "foreach"] = Field(
        "fused", description="The optimizer step's kernel: `fused` (TransformerEngine / apex FusedAdam, torch's "
        "fused AdamW: no temporaries) or `foreach` (torch AdamW's default, megatron-core's fallback without TE and "
        "apex: +4 bytes per parameter of the device's shard during the step).")


class RunProfile(Section):
    """The one validated description of a run: what `resolve_profile` gives every later stage."""

    model: ModelSection
    platform: Platform = Field(default_factory=Platform, description="Facts of the device kind.")
    backend: BackendName = Field("local", description="Training engine: " + "; ".join(
        f"`{card.name}`: {card.description}" for card in BACKEND_TABLE.values()) + " (profiles/backend_table.py).")
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    data: DataSection = Field(default_factory=DataSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    reward: RewardSection = Field(
        default_factory=RewardSection, description="The rewards users bring: verl- or TRL-style functions, a reward "
        "server; empty: the dataset's built-in reward (profiles/rewards.py).")
    actor: ActorSection = Field(default_factory=ActorSection)
    lora: LoraSection = Field(default_factory=LoraSection, description="A LoRA adapter instead of full fine-tuning "
                              "(profiles/lora.py).")
    engine: EngineSection = Field(
        default_factory=MegatronEngine, description="The training engine, by `engine.strategy` (profiles/engine.py).")
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    generation: GenerationSection = Field(
        default_factory=GenerationSection, description="How the local backend and the evaluation stage generate.")
    log_prob: LogProbSection = Field(default_factory=LogProbSection)
    planner: PlannerSection = Field(default_factory=PlannerSection, description="The memory planner.")
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    eval: EvalSection = Field(default_factory=EvalSection, description="The evaluation stage.")
    guards: GuardsSection = Field(default_factory=GuardsSection, description="Checks of every training step that "
                                  "stop a run failing silently (docs/guards.md).")
    tracking: TrackingSection = Field(
        default_factory=TrackingSection, description="Experiment trackers (MLflow, W&B, TensorBoard) that get the run.")
    proxy_policy: ProxyPolicy = Field(
        "bypass-cluster",
        description="What to do with http(s)/all proxy variables, for every device: `clear` removes them "
        "(both cases) on the driver and empties them on workers; `bypass-cluster` keeps the proxy for the "
        "outside world and adds localhost, 127.0.0.1 and the Ray head to NO_PROXY/no_proxy, so Ray, "
        "NCCL/HCCL and vLLM's local HTTP never go through it; `keep` changes nothing.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment every process of the run gets, on every node. A variable the user "
        "already exported wins over the value here; a whole value `${NAME}` or `${NAME:-default}` is read from "
        "the environment where the flow runs. A secret (a name like *TOKEN, *KEY, *PASSWORD) is only ever "
        "`${NAME}`: its value stays in that environment, reaches the driver only, and is never stored or shown.",
    )
    public_env: list[str] = Field(
        default_factory=list,
        description="Env entries whose value, read from the environment by a `${NAME}` reference, is no secret "
        "(`env.NCCL_SOCKET_IFNAME=${IFNAME}`): shown, stored and carried to Ray workers as a literal is. Any "
        "other value read by reference is held as a secret whatever the names (`***` wherever shown or stored, "
        "the driver only), so a secret under a name that does not look like one stays hidden. A secret-named "
        "entry, or a value with credentials in a URL, is a secret even here.",
    )
    requires: dict[str, NodeRequirement | None] = Field(
        default_factory=dict,
        description="What every node of a cluster run must have installed, by distribution name (and `python`, "
        "`cann`, `nvidia-driver`, `devices`): checked on each node before the job is submitted "
        "(profiles/requirements.py). The device profile, the model recipe and the backend add theirs; "
        "`requires.<name>: null` drops one.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def env_values_are_single_line_strings(cls, env: Any) -> Any:
        """YAML reads `HCCL_BUFFSIZE: 300` as an int; env values are strings, so scalars are
        converted. Names and values that no shell could export are refused."""
        if not isinstance(env, dict):
            return env
        clean = {}
        for name, value in env.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise ValueError(f"env name {name!r} is not a valid variable name (letters, digits, _)")
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, (int, float)):
                value = str(value)
            # The value is not echoed: it may be a secret.
            if not isinstance(value, str):
                raise ValueError(f"env {name}: its value is a {type(value).__name__}; it must be a single-line string")
            if "\n" in value or "\0" in value:
                raise ValueError(f"env {name}: its value spans several lines; it must be a single-line string")
            clean[name] = value
        return clean

    @property
    def world_size(self) -> int:
        return self.cluster.nnodes * self.cluster.devices_per_node

    @property
    def sequences_per_step(self) -> int:
        """Sequences a training step generates and learns from: `data.train_batch_size` prompts x
        `algorithm.rollout_n` responses each (the one place this product is computed)."""
        return self.data.train_batch_size * self.algorithm.rollout_n

    @property
    def sequences_per_update(self) -> int:
        """Sequences of one optimizer update: `actor.ppo_mini_batch_size` prompts x `algorithm.rollout_n`."""
        return self.actor.ppo_mini_batch_size * self.algorithm.rollout_n

    @property
    def uses_reference_model(self) -> bool:
        """A reference policy is computed (KL loss or in-reward KL); with LoRA it is the base model with the adapter
        disabled, so no copy of the weights is built (`builds_reference_model`)."""
        return self.algorithm.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def builds_reference_model(self) -> bool:
        """A second copy of the weights is built for the reference policy."""
        return self.uses_reference_model and not self.lora.enabled
