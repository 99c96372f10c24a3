"""Token-budget batching of one chunk: sort by length, cut batches, and keep the permutation.

Padding makes a batch cost about ``rows x longest row``, so batches of
similar lengths waste little; sorting longest-first also surfaces an
out-of-memory batch at the start of a chunk instead of the end.
"""

from __future__ import annotations


def plan_batches(
    tokens: list[int], target_batch_tokens: int, max_batch_size: int, sort_by_length: bool = True
) -> list[list[int]]:
    """Indices into `tokens`, grouped into batches whose padded cost stays within the budget.

    A batch's padded cost is ``len(batch) * max(tokens in batch)``. A single row over
    the budget still gets a batch of its own. Every index appears exactly once.
    """
    order = sorted(range(len(tokens)), key=lambda i: -tokens[i]) if sort_by_length else list(range(len(tokens)))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        t = max(1, tokens[i])
        new_longest = max(longest, t)
        if current and (len(current) >= max_batch_size or (len(current) + 1) * new_longest > target_batch_tokens):
            batches.append(current)
            current, new_longest = [], t
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches
