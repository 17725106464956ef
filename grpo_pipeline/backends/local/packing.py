"""Padding-free log-probs for TRL's GRPOTrainer: a micro batch's sequences packed into one row.

    python -m grpo_pipeline --model /models/Qwen3-1.7B --device gpu --set generation.attn_implementation=flash_attention_2

TRL 1.16's GRPO trains on (sequences x longest prompt + longest completion) with prompts padded on the
left and completions on the right: at 16 x 8 completions of up to 1,024 tokens whose lengths vary,
much of each forward and backward is padding. `packed_logprobs` stands in for the trainer's one log-prob
method (which the loss, the old-policy and the reference passes all call; backends/local/trl_hooks.py
overrides it) with one that keeps only the real tokens of each micro batch, in one row, positions
restarting at every sequence (transformers takes that as packed sequences when no attention mask is
given: varlen kernels with flash-attention, a block-diagonal mask otherwise), scores them through TRL's
fused LM head, and scatters the log-probs back to TRL's (batch, completion) layout: the loss, its
gradients and everything downstream are TRL's own. Images and MoE auxiliary losses go to TRL's path.

When: `engine.use_remove_padding` (the setting verl's engines read) with flash-attention kernels
(`generation.attn_implementation=flash_attention_2`): with SDPA or eager attention the packed row would
need a dense (tokens x tokens) mask, costing more than the padding saved. Off by default on a CPU.
"""

from __future__ import annotations

MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def pack(input_ids, attention_mask, logits_to_keep: int):
    """The real tokens of a padded batch as one row: ids (1, N), positions restarting at each
    sequence (1, N), labels (1, N) that score only the last `logits_to_keep` columns' real tokens (as
    TRL's padded path does), and where each (row, column) landed in the row (-1: padding)."""
    import torch

    real = attention_mask.bool()
    where = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    where[real] = torch.arange(int(real.sum()), device=input_ids.device)
    ids = input_ids[real].unsqueeze(0)
    counts = real.sum(dim=1)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(ids.size(1), device=ids.device) - torch.repeat_interleave(starts, counts)
    scored = real.clone()
    scored[:, :-logits_to_keep] = False
    labels = torch.where(scored[real], input_ids[real], torch.full_like(input_ids[real], -100)).unsqueeze(0)
    return ids, positions.unsqueeze(0), labels, where


def unpack(per_token, where, logits_to_keep: int):
    """(1, N - 1) values of the packed row (value j scores token j + 1) back to (batch,
    logits_to_keep), zero where TRL's padded path is zero (padding)."""
    import torch

    kept = where[:, -logits_to_keep:]
    padded = torch.cat([per_token.new_zeros(1), per_token[0]])  # token q's value sits at q - 1; 0 for padding
    return padded[kept.clamp(min=0)].masked_fill(kept < 0, 0)


def packable(compute_aux_loss: bool, multimodal: dict) -> bool:
    """Whether a log-prob pass can be packed: no images, no MoE auxiliary loss (those go to TRL's path)."""
    return not compute_aux_loss and all(multimodal.get(name) is None for name in MULTIMODAL)


def packed_logprobs(model, input_ids, attention_mask, logits_to_keep: int, batch_size: int | None,
                    compute_entropy: bool, autocast):
    """What TRL's log-prob method returns (log-probs, entropies or None, no auxiliary loss), from packed
    micro batches of `batch_size` rows (see the module); `autocast`: the trainer's accelerator's."""
    import torch

    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        ids, positions, labels, where = pack(input_ids[rows], attention_mask[rows], logits_to_keep)
        with autocast():
            out = model(input_ids=ids, position_ids=positions, labels=labels, fused_lm_head=True)
        logps.append(unpack(out.log_probs, where, logits_to_keep))
        if compute_entropy:
            entropies.append(unpack(out.entropy, where, logits_to_keep))
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


def padding_free(use_remove_padding: bool, attn_implementation: str) -> bool:
    """Whether the training batch is packed (the module's `When`)."""
    return use_remove_padding and attn_implementation == "flash_attention_2"
