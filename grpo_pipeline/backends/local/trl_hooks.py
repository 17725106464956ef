"""Every place the local backend reaches below TRL's public API, in one module, pinned to the TRL releases
it was checked against.

    .venv/bin/python -m pytest -q tests/test_trl_hooks.py   # names the method whose signature a TRL release moved

TRL's public hooks carry what they can: reward functions (backends/local/rewards.py), callbacks (the
metrics writer, the checkpoint publisher, the phase timer's step boundaries), `peft_config` (LoRA,
backends/local/lora.py), GRPOConfig's fields (backends/local/mapping.py). What they cannot, in TRL 1.16:

| private name | what the pipeline does there | why no public hook suffices |
|---|---|---|
| `_generate_single_turn` (override) | native decoder rollouts (rollouts.py), the mismatch probe's sampled log-probs (probe.py), the generation timer | `rollout_func` replaces TRL's generation outright: it must apply the chat template itself (TRL's `_tokenize_prompts`), has no way back to TRL's `generate` for a batch the native decoder refuses mid-run, and the probe and timer must watch TRL's own `generate` and vLLM rounds too |
| `_get_per_token_logps_and_entropies` (override, call) | packed log-prob passes (packing.py); the probe scores its rows with the loss's own pass | the one method the loss, the old-policy and the reference passes share; nothing public scores a sequence |
| `_get_train_sampler` (override) | each epoch's order a function of (seed, epoch) (data_order.py) | transformers' Trainer picks the sampler here; GRPOTrainer's `RepeatSampler` is seeded once |
| `_generate_and_score_completions`, `_prepare_inputs` (wrapped, phase timing only) | which log-prob pass is old / reference; the rewards' and batching's time (phases.py) | callbacks see step boundaries only |
| `_prepare_inputs` (override) | each update of a round divides its token-mean loss by its own tokens, as verl's does (`per_update_token_counts`) | TRL's `dapo` divides by the round's tokens spread evenly over its updates; no setting changes it |

One public method of transformers' Trainer is overridden (`PUBLIC_OVERRIDES`): `create_optimizer`, so that
weight decay reaches every parameter where verl's FSDP actor does so (backends/local/mapping.py) and a bf16
policy's optimizer steps fp32 copies of its weights as verl's does (backends/local/master_weights.py).

Private attributes read: `_tokenizer` (the text tokenizer of a processor), `_metrics` (where TRL's logged
means come from: the probe's `rollout/mismatch`), `_buffered_inputs` and `_step` (a round's micro batches, and
which one trains next). TRL calls `generate` on the unwrapped model inside
`_generate_single_turn`; the probe gives that call a logits processor while it records (`recording`).

A TRL outside `TRL_CHECKED` is checked when a run starts (`check_trl`): signatures as recorded, a
warning; a signature moved, the run is refused before anything starts, naming the method (a worker would
otherwise fail mid-run with a TypeError, or silently skip the override).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from importlib.metadata import version as installed_version

from packaging.specifiers import SpecifierSet

from grpo_pipeline.errors import UserError

TRL_CHECKED = SpecifierSet("==1.16.*")  # the releases whose GRPOTrainer the signatures below were read from

# name -> its signature in TRL_CHECKED's releases (str(inspect.signature(GRPOTrainer.<name>))).
PRIVATE_METHODS = {
    "_generate_single_turn": "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
    "_get_per_token_logps_and_entropies": (
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"),
    "_get_train_sampler": "(self, dataset: datasets.arrow_dataset.Dataset | None = None) -> torch.utils.data.sampler.Sampler",
    "_generate_and_score_completions": (
        "(self, inputs: list[dict[str, torch.Tensor | typing.Any]]) -> dict[str, torch.Tensor | typing.Any]"),
    "_prepare_inputs": (
        "(self, generation_batch: dict[str, torch.Tensor | typing.Any]) -> dict[str, torch.Tensor | typing.Any]"),
}
PRIVATE_ATTRIBUTES = ("_tokenizer", "_metrics", "_buffered_inputs", "_step")  # set in GRPOTrainer.__init__
# transformers' Trainer methods the local trainer replaces on purpose (every other public name it adds is new).
PUBLIC_OVERRIDES = ("create_optimizer",)


def signature_drift(trainer_class=None) -> list[str]:
    """One line per private method whose signature in the installed TRL differs from the recorded one."""
    if trainer_class is None:
        from trl import GRPOTrainer as trainer_class
    lines = []
    for name, recorded in PRIVATE_METHODS.items():
        method = getattr(trainer_class, name, None)
        now = "missing" if method is None else str(inspect.signature(method))
        if now != recorded:
            lines.append(f"GRPOTrainer.{name} is now {now}, checked as {recorded}")
    init = inspect.getsource(trainer_class.__init__)
    lines += [f"GRPOTrainer.__init__ no longer sets self.{name}" for name in PRIVATE_ATTRIBUTES
              if f"self.{name} =" not in init]
    return lines


def check_trl(version: str | None = None, trainer_class=None) -> str | None:
    """At a run's start: None on a checked TRL; on another, a warning line when every private method is as
    recorded, and a refusal (UserError) naming each one that moved."""
    version = version or installed_version("trl")
    if version in TRL_CHECKED:
        return None
    if drift := signature_drift(trainer_class):
        raise UserError(f"trl {version}: the local backend's TRL hooks were checked on trl{TRL_CHECKED} and "
                        f"{len(drift)} moved; pip install 'trl{TRL_CHECKED}' (backends/local/trl_hooks.py): "
                        + "; ".join(drift))
    return (f"trl {version} is not a release the local backend was checked on (trl{TRL_CHECKED}); the private "
            "methods it overrides have the recorded signatures, but their behaviour is unchecked")


@functools.cache
def grpo_trainer_class():
    """The local backend's GRPOTrainer: TRL's, with the overrides above; one class, made on first use so
    that importing this module (the driver's version check) imports no TRL."""
    from trl import GRPOTrainer

    from grpo_pipeline.backends.local import data_order, packing

    class LocalGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with, each off unless given: native rollouts (`native`), the mismatch probe
        (`probe`), packed log-prob passes (`packed`), the generation timer (`timer`), weight decay on every
        parameter (`decay_every_parameter`), fp32 master weights (`master_weights`); the epoch-seeded data
        order always."""

        def __init__(self, *args, native=None, probe=None, packed: bool = False, timer=None,
                     decay_every_parameter: bool = False, master_weights: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.native, self.probe, self.packed, self.timer = native, probe, packed, timer
            self.decay_every_parameter, self.master_weights = decay_every_parameter, master_weights
            self.native_refusal = native.refusal(self) if native else "not asked for"

        def native_decoder(self):
            """The native decoder of this trainer's policy (None where it cannot run)."""
            return self.native.decoder(self, self._tokenizer) if self.native and self.native_refusal is None else None

        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            if self.decay_every_parameter:
                # verl's FSDP actor decays every parameter (workers/config/optimizer.py build_optimizer passes
                # module.parameters() with one weight_decay); transformers puts biases and norms in a group without
                # decay, kept as a group (a checkpoint's optimizer state has the groups it was saved with).
                for group in optimizer.param_groups:
                    group["weight_decay"] = self.args.weight_decay
            if self.master_weights and not hasattr(optimizer, "fp32_copies"):
                from grpo_pipeline.backends.local.master_weights import with_master_weights

                self.optimizer = optimizer = with_master_weights(optimizer)  # the scheduler is made on it next
            return optimizer

        def _prepare_inputs(self, generation_batch):
            every = self.args.steps_per_generation * self.num_iterations
            fresh = self.model.training and (self._buffered_inputs is None or self._step % every == 0)
            inputs = super()._prepare_inputs(generation_batch)  # one of self._buffered_inputs' dicts
            if fresh and self.loss_type == "dapo":
                per_update_token_counts(self._buffered_inputs, self.args.gradient_accumulation_steps,
                                        lambda tokens: self.accelerator.reduce(tokens, reduction="sum"))
            return inputs

        def _get_train_sampler(self, dataset=None):
            return data_order.epoch_seeded(super()._get_train_sampler(dataset))

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                               compute_entropy=False, compute_aux_loss=False, **multimodal):
            if self.packed and packing.packable(compute_aux_loss, multimodal):
                return packing.packed_logprobs(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                               compute_entropy, self.accelerator.autocast)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            def trl_generate():
                return super(LocalGRPOTrainer, self)._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

            native = self.native_decoder() if not (images or multimodal_fields or has_tool_images) else None
            probe = self.probe if self.model.training else None  # evaluation rounds are not training's rollouts
            timing = self.timer.timing() if self.timer else contextlib.nullcontext()
            with recording(self.model, probe, len(prompt_ids), self.temperature) as sampled, timing:
                completions, logprobs, native_logprobs = (
                    self.native.generate(self, native, prompt_ids, trl_generate) if native else (*trl_generate(), None))
            # An engine that gives no log-probs (continuous batching) leaves the mismatch unmeasured, on every rank alike.
            if probe and (rollout := logprobs or native_logprobs or sampled.logprobs):
                import torch

                rows = min(probe.sequences, len(prompt_ids))
                device = self.accelerator.device
                mismatch = probe.mismatch(prompt_ids[:rows], completions[:rows], rollout[:rows], self.probe_logprobs,
                                          self._tokenizer.pad_token_id, device)
                value = self.accelerator.gather(torch.tensor([mismatch], device=device)).mean().item()
                self._metrics["train"][probe.key].append(value)
            return completions, logprobs

        def probe_logprobs(self, ids, mask, logits_to_keep):
            """The trainer's log-probs of the completions, by the pass its loss uses."""
            return self._get_per_token_logps_and_entropies(self.model, ids, mask, logits_to_keep)[0]

    return LocalGRPOTrainer


def per_update_token_counts(micro_batches: list[dict], accumulation: int, over_ranks) -> None:
    """Give each micro batch of a generation round the `num_items_in_batch` that makes TRL's token-mean divisor
    (num_items_in_batch / ranks x gradient_accumulation_steps / steps_per_generation, trl grpo_trainer.py:3172) the
    tokens of its own update, over every rank: verl's (workers/engine/fsdp/transformer_impl.py:730, the mini
    batch's `loss_mask` summed over the data-parallel group). TRL's own count is the round's, so with several
    updates a round (data.train_batch_size > actor.ppo_mini_batch_size, generation.steps_per_generation > 1) each
    update was weighted by its tokens against the round's mean. `over_ranks` sums a count over the ranks."""
    steps = len(micro_batches)
    for start in range(0, steps, accumulation):
        window = micro_batches[start:start + accumulation]
        tokens = over_ranks(sum(_loss_mask(batch).sum() for batch in window))
        for batch in window:
            batch["num_items_in_batch"] = tokens * steps / accumulation


def _loss_mask(batch: dict):
    """The tokens TRL's loss counts (grpo_trainer.py `_compute_loss`: the completion, less tool output)."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


@contextlib.contextmanager
def recording(model, probe, rows: int, temperature: float):
    """While TRL's `generate` runs (inside `_generate_single_turn`, on the unwrapped model: this instance),
    the probe's logits processor keeps the sampled log-probs of its first rows; nothing without a probe."""
    if probe is None:
        yield None
        return
    from transformers import LogitsProcessorList

    from grpo_pipeline.backends.local.probe import SampledLogProbs

    sampled = SampledLogProbs(min(probe.sequences, rows), temperature)
    own = vars(model).get("generate")
    generate = model.generate

    def recorded(*args, **kwargs):
        processors = LogitsProcessorList([*(kwargs.pop("logits_processor", None) or []), sampled])
        output = generate(*args, logits_processor=processors, **kwargs)
        sampled.finish(output if hasattr(output, "shape") else output.sequences)
        return output

    model.generate = recorded
    try:
        yield sampled
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def time_phases(trainer, phases) -> None:
    """The phase timer's wraps of TRL's private methods (backends/local/phases.py)."""
    phases.wrap(trainer, "_generate_single_turn", lambda *a, **k: "generation")
    phases.wrap(trainer, "training_step", lambda *a, **k: "forward_backward")
    # Called by training_step: rewards, advantages, buffering are not the forward's.
    phases.wrap(trainer, "_prepare_inputs", lambda *a, **k: "other")

    def logprob_phase(model, *args, **kwargs):
        if not phases.scoring:
            return None  # the loss's own forward: part of forward_backward
        return "ref_logprobs" if model is trainer.ref_model and model is not None else "old_logprobs"

    phases.wrap(trainer, "_get_per_token_logps_and_entropies", logprob_phase)
    phases.wrap_scoring(trainer, "_generate_and_score_completions")
