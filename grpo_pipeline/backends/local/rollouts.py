"""TRL's GRPOTrainer with its rollouts generated through generation/protocol.py's `TokenGenerator`:
the native decoder (generation/decoding.py), when the run's `GenerationPlan` names it.

    python -m grpo_pipeline --model tiny --device cpu --set generation.decoder=native

TRL 1.16 generates in `GRPOTrainer._generate_single_turn(prompt_ids, images, multimodal_fields,
num_generations)`, where it already branches between vLLM, continuous batching and `generate`, and
which returns the completions' token ids (up to and including end-of-sequence) and their log-probs.
This subclass answers there and leaves the rest of GRPO (rewards, advantages, the old policy's
log-probs recomputed by the trainer's forward, the loss) to TRL. It hands back to TRL's own path
whatever the native decoder does not do: continuous batching, images, sharded parameters
(DeepSpeed ZeRO-3, FSDP), a model outside the Llama family, min_p, a repetition penalty, or
generation kwargs other than min_new_tokens (facts of the trainer and the model; whether rollouts are
native at all, or vLLM, the plan decided). Imported only inside a training worker (it imports TRL).
"""

from __future__ import annotations

import contextlib

from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from grpo_pipeline.generation.batches import token_generator
from grpo_pipeline.generation.decode_step import Sampling
from grpo_pipeline.generation.decoding import unsupported
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import TokenGenerator

NATIVE_GENERATION_KWARGS = {"min_new_tokens"}  # what the native decoder does of args.generation_kwargs


class NativeRolloutTrainer(GRPOTrainer):
    def __init__(self, *args, plan: GenerationPlan, max_prompt_tokens: int | None = None, timer=None,
                 compile_cache_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._plan, self._max_prompt_tokens, self._timer = plan, max_prompt_tokens, timer
        self._compile_cache_dir = compile_cache_dir
        self._decoder: TokenGenerator | None = None
        self.native_refusal = self._refusal()

    def _refusal(self) -> str | None:
        """Why this trainer's rollouts cannot be native (None: they are)."""
        args = self.args
        if self.use_transformers_continuous_batching:
            return "continuous batching is on"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "the parameters are sharded (DeepSpeed / FSDP)"
        if self.min_p or (self.repetition_penalty or 1.0) != 1.0:
            return "min_p / repetition_penalty"
        if set(args.generation_kwargs or {}) - NATIVE_GENERATION_KWARGS:
            return f"generation_kwargs {sorted(set(args.generation_kwargs) - NATIVE_GENERATION_KWARGS)}"
        return unsupported(self.accelerator.unwrap_model(self.model))

    def native_decoder(self) -> TokenGenerator | None:
        if self.native_refusal is None and self._decoder is None:
            self._decoder, _ = token_generator(self.accelerator.unwrap_model(self.model), self._tokenizer, self._plan,
                                               self.eos_token_ids, self._compile_cache_dir)
        return self._decoder

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        decoder = None if (images or multimodal_fields or has_tool_images) else self.native_decoder()
        if decoder is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        sampling = Sampling(temperature=self.temperature, top_k=self.top_k or 0, top_p=self.top_p or 1.0,
                            min_new_tokens=(self.args.generation_kwargs or {}).get("min_new_tokens", 0))
        timing = self._timer.timing() if self._timer else contextlib.nullcontext()
        try:
            with profiling_context(self, "native.generate"), timing:
                if self._max_prompt_tokens:
                    decoder.reserve(len(prompt_ids), self._max_prompt_tokens + self.max_completion_length)
                out = decoder.generate(prompt_ids, self.max_completion_length, sampling)
        except ValueError as error:  # what the decoder refuses (a context too short for prompt + completion)
            self.native_refusal, self._decoder = str(error), None
            print(f"rollouts: transformers generate from now on, not native decoding: {error}", flush=True)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        # The trainer recomputes the old policy's log-probs with its own forward, as it does after
        # transformers' generate; returning None keeps that path exactly TRL's. The sampled log-probs are
        # the mismatch probe's (backends/local/probe.py).
        self.last_rollout_logprobs = out.logprobs
        return out.completions, None

