"""The local backend's rollout/trainer mismatch probe: is the rollout engine generating with the weights
the trainer trains?

    python -m grpo_pipeline --model tiny --device cpu --set guards.probe_sequences=8   # metrics.jsonl: mismatch

On each generation round, the first `guards.probe_sequences` sequences of every worker are scored
again by the trainer's own log-prob pass (the one its loss uses: backends/local/trl_hooks.py), under the weights they were generated with, and compared token by token with the log-probs the
rollout engine sampled them with: KL per token, the k3 estimator E[exp(d) - d - 1] with d the trainer's
minus the rollout's log-prob (verl's `rollout_corr/k3_kl`). A healthy run stays near 0 (fp32) or below
0.01 (bf16 kernels that differ); a rollout engine left on older weights drifts away as training moves
them, which the `rollout_mismatch` guard (backends/guards.py) stops.

Where the rollout's log-probs come from: vLLM returns them (TRL keeps the sampled token's), the native
decoder computes them while it samples (backends/local/rollouts.py), and transformers' `generate`, which
gives none, is watched by `SampledLogProbs`, a logits processor that keeps them for the probed rows.
Imported only inside a training worker (it imports TRL).
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor
from trl.trainer.utils import pad

MISMATCH = "rollout/mismatch"  # the key in TRL's logged metrics (backends/local/worker.py reads it)


class SampledLogProbs(LogitsProcessor):
    """The log-probs (under softmax(logits / temperature), the distribution the trainer scores) of the
    tokens `generate` samples for its first `rows` rows. transformers applies the temperature after the
    processors a caller gives, so the scores here are the raw ones; each step's choice is read at the
    next call, from the token it appended, and the last one from the finished sequences."""

    def __init__(self, rows: int, temperature: float):
        self.rows, self.temperature = rows, temperature
        self.previous: torch.Tensor | None = None
        self.logprobs: list[list[float]] = []

    def __call__(self, input_ids, scores):
        self._take(input_ids)
        self.previous = torch.log_softmax(scores[: self.rows].float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences) -> None:
        self._take(sequences)
        self.previous = None

    def _take(self, sequences) -> None:
        if self.previous is None:
            return
        chosen = self.previous.gather(1, sequences[: self.rows, -1:].to(self.previous.device)).squeeze(1).tolist()
        if not self.logprobs:
            self.logprobs = [[] for _ in chosen]
        for kept, value in zip(self.logprobs, chosen):
            kept.append(value)


def k3_mismatch(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the masked tokens of exp(d) - d - 1, d = trainer - rollout log-prob (NaN stays NaN)."""
    d = (trainer - rollout).double()
    k3 = torch.expm1(d) - d  # exp(d) - 1 - d without the cancellation that rounds a small one to 0
    return float(torch.where(mask.bool(), k3, 0.0).sum() / mask.sum().clamp(min=1))


class RolloutProbe:
    """Each generation round's mismatch on its first `sequences` rows, for TRL's metrics as `rollout/mismatch`
    (averaged over the workers, so every rank logs the same number). backends/local/trl_hooks.py calls it
    from the trainer's rollouts, with the rollout engine's log-probs and the trainer's scoring pass."""

    key = MISMATCH

    def __init__(self, sequences: int):
        self.sequences = sequences

    def mismatch(self, prompts: list[list[int]], completions: list[list[int]], rollout: list[list[float]], score,
                 pad_id: int, device) -> float:
        """The trainer's log-probs of these completions now (`score`: the weights they were generated with),
        against the rollout's."""
        prompt_ids = pad([torch.tensor(p) for p in prompts], padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompts], padding_value=0,
                          padding_side="left").to(device)
        completion_ids = pad([torch.tensor(c) for c in completions], padding_value=pad_id, padding_side="right").to(device)
        mask = pad([torch.ones(len(c), dtype=torch.long) for c in completions], padding_value=0,
                   padding_side="right").to(device)
        # vLLM gives None for a NaN log-prob: NaN it is.
        sampled = pad([torch.tensor([math.nan if v is None else v for v in lps[: len(c)]], dtype=torch.float32)
                       for lps, c in zip(rollout, completions)], padding_value=0.0, padding_side="right").to(device)
        with torch.no_grad():  # in the model's training mode, as TRL's own old-policy pass
            trainer = score(torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, mask], dim=1),
                            completion_ids.size(1))
        width = min(trainer.size(1), sampled.size(1))
        return k3_mismatch(trainer[:, :width], sampled[:, :width], mask[:, :width])
