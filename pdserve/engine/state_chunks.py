"""Where a hybrid model's prefill chunks end, so that its recurrent state can be snapshotted.

A recurrent-state layer keeps only the state after the last token it computed, so the prefix cache
can reuse a prompt's state only at points where a step ended: the scheduler ends such a model's
prefill chunks on block boundaries (rounding the budget down by less than one block) and always at
the prompt's last full block, where a later prompt sharing this one most often diverges. Each of
those ends is a snapshot point (`KVCacheManager.commit(..., prompt_boundary=True)`). Torch-free.

    prompt of 70 tokens, block size 16, budget 40 (last full block before the last token ends at 64):
      chunk 1: [0, 32)   the budget's end 40 rounded down to a block boundary    -> snapshot at 32
      chunk 2: [32, 64)  the budget's end 72 is past 64: cut at the prompt's cut  -> snapshot at 64
      chunk 3: [64, 70)  the prompt's tail; its last token's logits sample the first output token
"""

from __future__ import annotations

from pdserve.kv.prefix import max_hit_blocks


def last_full_block_end(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens in the prompt's full blocks before its last token (the last token is always computed):
    the most a later prompt can take from the cache (`max_hit_blocks`, the one rule)."""
    return max_hit_blocks(num_prompt_tokens, block_size) * block_size


def snapshot_chunk_tokens(num_computed: int, num_new: int, num_prompt_tokens: int, block_size: int) -> int:
    """The chunk size to schedule instead of `num_new` (never more, never 0 when num_new > 0)."""
    end = num_computed + num_new
    if num_new <= 0 or num_computed >= num_prompt_tokens - 1:
        return num_new  # decoding (or the prompt's last token): one token at a time anyway
    prompt_cut = last_full_block_end(num_prompt_tokens, block_size)
    if num_computed < prompt_cut < end:
        return prompt_cut - num_computed
    if end >= num_prompt_tokens:
        return num_new  # the prompt's tail after its last full block
    rounded = end // block_size * block_size
    return rounded - num_computed if rounded > num_computed else num_new


def is_snapshot_point(num_computed: int, num_prompt_tokens: int, block_size: int) -> bool:
    """Whether a prefill chunk that ended with `num_computed` tokens left a state worth keeping."""
    return 0 < num_computed <= last_full_block_end(num_prompt_tokens, block_size) and num_computed % block_size == 0
