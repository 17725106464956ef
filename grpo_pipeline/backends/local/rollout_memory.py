"""Do the local backend's rollouts fit in memory? Checked at planning, from the profile alone.

    python -m grpo_pipeline --model tiny --device cpu --dry-run \
        --set model.architecture.max_position_embeddings=33554432 --set data.max_response_length=16777216   # refused

Each worker decodes its share of a generation round at once (generation/decoding.py's static cache,
sized by backends/local/rollouts.py): per sequence, prompt + response positions of keys and values
in every full-attention layer, the step's token ids and log-probs, and any linear-attention state;
beside it the worker's own copy of the weights. That is a floor (training adds gradients, the
optimizer and activations), so what it refuses cannot run; without it a length the model allows
(data.max_response_length up to 16777216) allocated 137 GB on a tiny model before failing.
"""

from __future__ import annotations

import math

from grpo_pipeline.generation.plan import steps_per_round
from grpo_pipeline.profiles.model_size import kv_bytes_per_token, linear_state_bytes_per_sequence, model_size, size_problems
from grpo_pipeline.profiles.schema import RunProfile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3
# The decoder's per-position state besides the cache: the token id (int64) and its log-prob (float32).
STATE_BYTES_PER_POSITION = 8 + 4


def rollout_batch(p: RunProfile) -> int:
    """Sequences one worker decodes at once: its share of a generation round (backends/local/mapping.py's
    generation_batch_size over the data-parallel workers)."""
    round_size = p.sequences_per_step * steps_per_round(p)
    return math.ceil(round_size / p.world_size)


def decoding_state(p: RunProfile, dtype: int) -> tuple[float, float]:
    """(bytes per position, bytes whatever the length) of the decoder's state for one worker's rollout
    batch: keys and values, token id and log-prob per position; the linear-attention layers' state."""
    arch, batch = p.model.architecture, rollout_batch(p)
    return (batch * (kv_bytes_per_token(arch, 1, dtype) + STATE_BYTES_PER_POSITION),
            batch * linear_state_bytes_per_sequence(arch, 1, dtype))


def available_memory(p: RunProfile) -> tuple[float | None, str]:
    """(bytes the workers of one device may use, where the number comes from). A CPU run's workers
    share the host: its memory available now unless the platform names a size."""
    platform = p.platform
    reserved = platform.reserved_memory_gib * GIB
    if platform.accelerated:
        _, memory_gib, source = platform.device_memory()
        return (None, source) if memory_gib is None else (memory_gib * GIB - reserved, source)
    if platform.device_memory_gib:
        return platform.device_memory_gib * GIB - reserved, "platform.device_memory_gib"
    import psutil

    return psutil.virtual_memory().available - reserved, "host memory available now"


def rollout_memory_problems(p: RunProfile) -> list[str]:
    """A prompt + response length whose rollouts cannot fit: the setting, the bytes it needs, the
    largest length that fits."""
    arch = p.model.architecture
    if not (arch.num_layers and arch.num_kv_heads and (arch.head_dim or arch.hidden_size)):
        return []
    available, source = available_memory(p)
    if available is None:
        return []
    dtype = DTYPE_BYTES.get(p.platform.run_dtype(p.engine.dtype), 4)
    sharing = 1 if p.platform.accelerated else p.world_size  # CPU workers share one memory
    batch = rollout_batch(p)
    weights = model_size(arch).total * dtype if not size_problems(arch) else 0
    per_position, state = decoding_state(p, dtype)
    fixed = weights + state
    prompt, response = p.data.max_prompt_length, p.data.max_response_length
    needed = sharing * (fixed + per_position * (prompt + response))
    if needed <= available:
        return []
    room = math.floor(available / sharing - fixed) // per_position - prompt
    fix = (f"set data.max_response_length <= {room}" if room > 0 else
           f"lower data.max_prompt_length (or the sequences per worker)")
    workers = f" x {sharing} workers" if sharing > 1 else ""
    return [f"data.max_response_length={response}: rollouts need {needed} bytes ({needed / GIB:.1f} GiB: {batch} "
            f"sequences per worker x {prompt + response} positions of KV cache, with the weights{workers}), more than "
            f"the {available / GIB:.1f} GiB of {source}; {fix} (or fewer sequences per worker: data.train_batch_size "
            "x algorithm.rollout_n / workers)"]
