"""How many steps a verl run trains, counted as verl 0.9.1 counts them, and the counts its loop gets wrong."""

from __future__ import annotations

import pyarrow.parquet as pq

from grpo_pipeline.profiles.schema import RunProfile


def planned_steps(profile: RunProfile, train_files: list[str]) -> int:
    """verl's step count: trainer.total_training_steps, else whole batches per epoch x epochs (its
    dataloader drops the last partial batch). verl may count fewer after filtering overlong prompts."""
    if profile.trainer.total_training_steps:
        return profile.trainer.total_training_steps
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in train_files)
    return max(1, rows // profile.data.train_batch_size) * profile.trainer.total_epochs


def step_count_problem(profile: RunProfile, train_files: list[str]) -> str | None:
    """What verl 0.9.1's loop would do wrong with this step count (v1 trainer_base.fit): it divides by
    the whole batches of an epoch (none: ZeroDivisionError), and it stops after trainer.total_epochs
    even when trainer.total_training_steps asks for more, without saving that last step."""
    t, batch = profile.trainer, profile.data.train_batch_size
    per_epoch = sum(pq.ParquetFile(path).metadata.num_rows for path in train_files) // batch
    if per_epoch == 0:
        return (f"data.train_batch_size={batch}: the training data holds less than one batch, and verl trains on whole "
                "batches only; lower data.train_batch_size or use more training rows")
    if t.total_training_steps and t.total_training_steps > per_epoch * t.total_epochs:
        epochs = -(-t.total_training_steps // per_epoch)
        return (f"trainer.total_training_steps={t.total_training_steps} is more than trainer.total_epochs="
                f"{t.total_epochs} of {per_epoch} whole batches of {batch} give; verl would stop after its last epoch "
                f"without saving its last step: set trainer.total_epochs={epochs}")
    return None
