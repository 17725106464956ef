"""The local backend's training step sized by the planner: the micro batch and gradient checkpointing, for the GPUs found.

    python -m grpo_pipeline --model /models/Qwen3-8B --device auto --set lora.rank=16 --dry-run   # "# memory plan: ..."

What users otherwise guess. On a host whose devices were counted (`LocalBackend.detected_layer`), with the step's
memory model (train_memory.py `step_memory`: weights, the full model's or the adapter's training state,
activations, the LM head, what rollouts keep):
- gradient checkpointing off wherever some micro batch fits without it (recomputation costs about a third more
  forward compute on every token), on otherwise;
- `actor.ppo_micro_batch_size_per_gpu`, TRL's per-device batch of every pass (log-probs, reference, update): the
  largest that fits the device with the checkpointing chosen, among those that divide the completions one
  worker takes per optimizer step (TRL accumulates the rest: fewer, larger passes, the same update).
A setting that a recipe, a profile file or --set gives wins, and the other is decided around it (a micro batch
given: checkpointing only if that micro batch needs it); a step that fits with nothing is left as the profile has
it, and the dry run says so with the largest micro batch that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_pipeline.backends.local.train_memory import GIB, HEADROOM, step_memory
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.planner.roles import largest_batch_row, largest_batch_table, largest_fitting
from grpo_pipeline.planner.rules import divisors
from grpo_pipeline.profiles.schema import RunProfile

MICRO_BATCH = "actor.ppo_micro_batch_size_per_gpu"
CHECKPOINTING = "model.enable_gradient_checkpointing"


@dataclass(frozen=True)
class StepSizing:
    """The planner's micro batch and checkpointing for one device, and the numbers behind them."""

    micro_batch: int
    checkpointing: bool
    fits: bool
    needed: float  # bytes of the step at this micro batch and checkpointing
    usable: float
    candidates: tuple[int, ...]  # the micro batches it chose among (one when given)

    @property
    def layer(self) -> dict:
        """The detected layer's settings: both (a given one is above it anyway); checkpointing alone where nothing
        fits (the profile's micro batch stands, with the recomputation that saves most)."""
        if not self.fits:
            return {"model": {"enable_gradient_checkpointing": self.checkpointing}}
        return {"model": {"enable_gradient_checkpointing": self.checkpointing},
                "actor": {"ppo_micro_batch_size_per_gpu": self.micro_batch}}


def micro_batch_note(p: RunProfile, free: StepSizing) -> str:
    """The dry run's words on the profile's micro batch beside the planner's own choice `free` (nothing given)."""
    micro = p.actor.ppo_micro_batch_size_per_gpu
    if not free.fits:
        return (f"no micro batch fits even with gradient checkpointing on (micro batch {free.micro_batch} needs "
                f"{free.needed / GIB:.1f} GiB of {free.usable / GIB:.1f} GiB usable); lower data.max_response_length, "
                "or train an adapter (lora.rank=16)")
    largest = f"the largest of {', '.join(map(str, free.candidates))} (divisors of the update's completions per worker)"
    if micro == free.micro_batch:
        return f"micro batch {micro}: {largest} that fits"
    return (f"micro batch {micro}, as a recipe, a profile file or --set has it; {free.micro_batch} is {largest} that "
            f"fits with gradient checkpointing {'on' if free.checkpointing else 'off'}")


def micro_batch_candidates(p: RunProfile) -> tuple[int, ...]:
    """The micro batches that divide the completions one worker takes per optimizer step."""
    return tuple(divisors(max(p.sequences_per_update // max(p.world_size, 1), 1)))


def step_bytes(p: RunProfile, generation: GenerationPlan, micro: int, checkpointing: bool, memory: float) -> float | None:
    """The step's peak (train_memory.py) at micro batch `micro` on a device of `memory` bytes; None: not sizable."""
    sized = p.model_copy(update={"actor": p.actor.model_copy(update={"ppo_micro_batch_size_per_gpu": micro})})
    step = step_memory(sized, generation, checkpointing, memory)
    return None if step is None else step.total


def usable_bytes(p: RunProfile, memory: float) -> float:
    """What the step may take of a device: less the headroom (train_memory.py) and platform.reserved_memory_gib."""
    return memory * (1 - HEADROOM) - p.platform.reserved_memory_gib * GIB


def size_step(p: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
              detected_gib: list[float] | None = None, given: frozenset[str] = frozenset()) -> StepSizing | None:
    """The micro batch and checkpointing for one device of the run (see the module); None on a CPU, and where
    the device's memory or the model's size is unknown."""
    if not p.platform.accelerated:
        return None
    _, memory_gib, _ = p.platform.device_memory(detected_names, detected_gib)
    if memory_gib is None:
        return None
    memory, micro = memory_gib * GIB, p.actor.ppo_micro_batch_size_per_gpu
    usable = usable_bytes(p, memory)
    candidates = (micro,) if MICRO_BATCH in given else micro_batch_candidates(p)
    modes = (p.model.enable_gradient_checkpointing,) if CHECKPOINTING in given else (False, True)
    for checkpointing in modes:
        best = None
        for m in candidates:  # ascending: the step grows with the micro batch
            if (needed := step_bytes(p, generation, m, checkpointing, memory)) is None:
                return None
            if needed > usable:
                break
            best = (m, needed)
        if best:
            return StepSizing(best[0], checkpointing, True, best[1], usable, candidates)
    needed = step_bytes(p, generation, candidates[0], modes[-1], memory) or 0.0
    return StepSizing(candidates[0], modes[-1], False, needed, usable, candidates)


STEPS_PER_GENERATION = "generation.steps_per_generation"


def size_rounds(p: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
                detected_gib: list[float] | None = None, given: frozenset[str] = frozenset()) -> tuple[StepSizing | None, int]:
    """`size_step`, and the steps whose prompts one rollout round generates (their KV cache is kept beside the step):
    the profile's, or where no micro batch fits beside that many rounds' rollouts and it is not given, the largest
    fewer that fits (halved down to 1: every step generating its own, as verl does)."""
    rounds = generation.steps_per_generation
    sizing = size_step(p, generation, detected_names, detected_gib, given)
    while sizing is not None and not sizing.fits and rounds > 1 and STEPS_PER_GENERATION not in given:
        fewer = max(rounds // 2, 1)
        tried = size_step(p.model_copy(update={"generation": p.generation.model_copy(update={"steps_per_generation": fewer})}),
                          generation.model_copy(update={"steps_per_generation": fewer}), detected_names, detected_gib, given)
        if tried is None:
            break
        rounds, sizing = fewer, tried
    return sizing, rounds


def no_fit_refusal(sizing: StepSizing) -> str:
    """A run whose step fits the devices found at no micro batch (planner.enforce): the headline, then details."""
    return (f"the training step does not fit the device: micro batch {sizing.micro_batch} needs {sizing.needed / GIB:.1f} "
            f"GiB of {sizing.usable / GIB:.1f} GiB usable; train an adapter (lora.rank=16)\n"
            "even with gradient checkpointing on and one step's prompts per generation\n"
            "or lower data.max_response_length or data.train_batch_size; planner.enforce=false runs it anyway")


def largest_micro_batch(p: RunProfile, generation: GenerationPlan, checkpointing: bool, memory: float) -> tuple[int, float] | None:
    """The largest micro batch whose step fits the device, and its bytes; None when not even one sequence fits."""
    usable = usable_bytes(p, memory)

    def needed(m: int) -> float:
        found = step_bytes(p, generation, m, checkpointing, memory)
        return float("inf") if found is None else found

    largest = largest_fitting(lambda m: needed(m) <= usable)
    return None if largest is None else (largest, needed(largest))


def one_device_table(p: RunProfile, generation: GenerationPlan) -> tuple[dict, list[str]]:
    """`--suggest-layout --backend local` on one device: the largest micro batch that fits, full training and
    LoRA (the profile's rank, else 16), gradient checkpointing off and on, at the profile's lengths and rollout
    batch; as JSON (`refusal` when not one sequence fits) and as the lines printed."""
    name, memory_gib, source = p.platform.device_memory()
    if memory_gib is None:
        refusal = f"--suggest-layout needs the device's memory ({source})"
        return {"refusal": refusal}, []
    memory = memory_gib * GIB
    usable = usable_bytes(p, memory)
    rank = p.lora.rank or 16
    p = p.model_copy(update={"cluster": p.cluster.model_copy(update={"nnodes": 1, "devices_per_node": 1})})  # one worker
    rows = []
    for label, lora in (("full", p.lora.model_copy(update={"rank": 0})), (f"LoRA r{rank}", p.lora.model_copy(update={"rank": rank}))):
        trained = p.model_copy(update={"lora": lora})
        for checkpointing in (False, True):
            found = largest_micro_batch(trained, generation, checkpointing, memory)
            rows.append(largest_batch_row(label, checkpointing, *(found or (None, None))))
    d = p.data
    device = f"{memory_gib:.1f} GiB {name} ({source}), {usable / GIB:.1f} GiB usable"
    tokens = d.max_prompt_length + d.max_response_length
    rollouts = f"{d.train_batch_size} x {p.algorithm.rollout_n} x {generation.steps_per_generation} step(s)' prompts"
    return largest_batch_table(
        f"# the largest micro batch of {tokens}-token sequences one device's training step fits: {device}; rollouts of "
        f"{rollouts} per generation kept beside it", "step", device, tokens, rows,
        f"not one sequence of {p.model.name} fits one {name} device, even as LoRA with gradient checkpointing; lower "
        "generation.steps_per_generation, data.train_batch_size or data.max_response_length (the rollouts' KV cache "
        "grows with each)")
