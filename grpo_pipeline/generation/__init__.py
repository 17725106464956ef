"""How rollouts and evaluation generate, below the stages and the backends that both use it.

    python -m grpo_pipeline --model tiny --device cpu --dry-run --json   # its plan: the `generation` key

`plan.py` decides the path once, at planning (`GenerationPlan`); `protocol.py` is what generating
means (`TokenGenerator`, token ids to completions, for rollouts and evaluation alike; `Generate`, chat
prompts to responses, for evaluation); `batches.py` puts the transformers model's two decoders behind
the protocol; `decoding.py` and `decode_step.py` are the native decoder; `compiled.py` compiles
`generate`'s decode step; `engines.py` holds the engines (transformers, vLLM) and `sharding.py` where
they run (this host's devices, a cluster's nodes).
"""
