"""The local backend's data order: the same batches at every step whether the run was resumed or not.

    python -m grpo_pipeline --model tiny --device cpu --set trainer.total_epochs=3 --set trainer.total_training_steps=null

TRL 1.16's `RepeatSampler` draws each epoch's order from one generator, seeded once: an uninterrupted
run's second epoch is the generator's second permutation, but a run resumed in its second epoch builds a
fresh sampler, whose first permutation is the first epoch's again (transformers 5 skips the trained
batches of the resumed epoch, and nothing replays the epochs before it). `EpochSeededSampler` makes each
epoch's order a function of (seed, epoch), set by the `set_epoch` that transformers and accelerate call
before every epoch, resumed or not; the first epoch's order is the one TRL's sampler draws.
tests/e2e/test_local_guards.py checks the first batch after a resume (mid-epoch and at an epoch
boundary) against the uninterrupted run's batch at that step.
"""

from __future__ import annotations

from trl.trainer.utils import RepeatSampler


class EpochSeededSampler(RepeatSampler):
    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) + epoch)


def epoch_seeded(drawn):
    """The training sampler TRL drew, as an `EpochSeededSampler` (backends/local/trl_hooks.py asks here)."""
    if type(drawn) is not RepeatSampler:  # not the sampler this fix is for: TRL's own choice stands
        return drawn
    return EpochSeededSampler(drawn.data_source, mini_repeat_count=drawn.mini_repeat_count, batch_size=drawn.batch_size,
                              repeat_count=drawn.repeat_count, shuffle=drawn.shuffle, seed=drawn.seed)
