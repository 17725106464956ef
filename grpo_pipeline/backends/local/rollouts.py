"""TRL's GRPOTrainer with its rollouts generated through generation/protocol.py's `TokenGenerator`:
the native decoder (generation/decoding.py), when the run's `GenerationPlan` names it.

    python -m grpo_pipeline --model tiny --device cpu --set generation.decoder=native

TRL 1.16 generates in `GRPOTrainer`'s single-turn generation method (backends/local/trl_hooks.py overrides
it), where it already branches between vLLM, continuous batching and `generate`, and which returns the
completions' token ids (up to and including end-of-sequence) and their log-probs. `NativeRollouts`
answers there and leaves the rest of GRPO (rewards, advantages, the old policy's log-probs recomputed by
the trainer's forward, the loss) to TRL. It hands back to TRL's own path whatever the native decoder
does not do: continuous batching, images, sharded parameters (DeepSpeed ZeRO-3, FSDP), a model outside
the Llama family, min_p, a repetition penalty, or generation kwargs other than min_new_tokens (facts of
the trainer and the model; whether rollouts are native at all, or vLLM, the plan decided). It reads
only the trainer's public attributes. Imported only inside a training worker.
"""

from __future__ import annotations

from trl.extras.profiling import profiling_context

from grpo_pipeline.generation.batches import token_generator
from grpo_pipeline.generation.decode_step import Sampling
from grpo_pipeline.generation.decoding import unsupported
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.generation.protocol import TokenGenerator

NATIVE_GENERATION_KWARGS = {"min_new_tokens"}  # what the native decoder does of args.generation_kwargs


class NativeRollouts:
    """The native decoder behind a GRPOTrainer's rollouts: built on first use, dropped (for TRL's own
    `generate`) at the first batch it refuses."""

    def __init__(self, plan: GenerationPlan, max_prompt_tokens: int | None = None, compile_cache_dir: str | None = None):
        self.plan, self.max_prompt_tokens, self.compile_cache_dir = plan, max_prompt_tokens, compile_cache_dir
        self._decoder: TokenGenerator | None = None

    @staticmethod
    def refusal(trainer) -> str | None:
        """Why this trainer's rollouts cannot be native (None: they are)."""
        args = trainer.args
        if trainer.use_transformers_continuous_batching:
            return "continuous batching is on"
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            return "the parameters are sharded (DeepSpeed / FSDP)"
        if trainer.min_p or (trainer.repetition_penalty or 1.0) != 1.0:
            return "min_p / repetition_penalty"
        if set(args.generation_kwargs or {}) - NATIVE_GENERATION_KWARGS:
            return f"generation_kwargs {sorted(set(args.generation_kwargs) - NATIVE_GENERATION_KWARGS)}"
        return unsupported(trainer.accelerator.unwrap_model(trainer.model))

    def decoder(self, trainer, tokenizer) -> TokenGenerator:
        if self._decoder is None:
            self._decoder, _ = token_generator(trainer.accelerator.unwrap_model(trainer.model), tokenizer, self.plan,
                                               trainer.eos_token_ids, self.compile_cache_dir)
        return self._decoder

    def generate(self, trainer, decoder: TokenGenerator, prompt_ids: list[list[int]], trl_generate):
        """(completion ids, None, the sampled log-probs): None where TRL puts an engine's log-probs, so that
        the trainer recomputes the old policy's with its own forward, exactly as after transformers'
        `generate`; the sampled ones are the mismatch probe's (backends/local/probe.py). A batch the decoder
        refuses goes to `trl_generate`, and so does every later one."""
        sampling = Sampling(temperature=trainer.temperature, top_k=trainer.top_k or 0, top_p=trainer.top_p or 1.0,
                            min_new_tokens=(trainer.args.generation_kwargs or {}).get("min_new_tokens", 0))
        try:
            with profiling_context(trainer, "native.generate"):
                if self.max_prompt_tokens:
                    decoder.reserve(len(prompt_ids), self.max_prompt_tokens + trainer.max_completion_length)
                out = decoder.generate(prompt_ids, trainer.max_completion_length, sampling)
        except ValueError as error:  # what the decoder refuses (a context too short for prompt + completion)
            trainer.native_refusal, self._decoder = str(error), None
            print(f"rollouts: transformers generate from now on, not native decoding: {error}", flush=True)
            return (*trl_generate(), None)
        return out.completions, None, out.logprobs
