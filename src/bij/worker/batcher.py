"""Order and batch the rows of the in-flight window: shared prefixes together, then by length.

Padding makes a batch cost about ``rows x longest row``, so batches of
similar lengths waste little; sorting longest-first also surfaces an
out-of-memory batch early. Prompts that share a prefix (a system prompt, a
few-shot block, a chat template) run together so that an engine with a prefix
cache (vLLM) computes the prefix once. Every function returns indices, so the
caller keeps the permutation and restores input order.
"""

from __future__ import annotations

from collections.abc import Iterable

# Prompts sharing fewer leading characters than this are not a prefix group ("The ", "{").
MIN_SHARED_PREFIX = 32


def plan_batches(
    tokens: list[int], target_batch_tokens: int, max_batch_size: int, sort_by_length: bool = True,
    max_padding_waste: float | None = None,
) -> list[list[int]]:
    """Indices into `tokens`, grouped into batches whose padded cost stays within the budget.

    A batch's padded cost is ``len(batch) * max(tokens in batch)``. With `max_padding_waste`
    a batch of at least a quarter of `max_batch_size` rows is also cut before its padding
    (padded minus real tokens) would pass that share of its padded cost. A single row over
    the budget still gets a batch of its own. Every index appears exactly once.
    """
    order = sorted(range(len(tokens)), key=lambda i: -tokens[i]) if sort_by_length else list(range(len(tokens)))
    return cut_batches([max(1, tokens[i]) for i in order], order, target_batch_tokens, max_batch_size,
                       max_padding_waste)


def cut_batches(lengths: list[int], order: list[int], target_batch_tokens: int, max_batch_size: int,
                max_padding_waste: float | None = None) -> list[list[int]]:
    """Cut `order` (already in run order, `lengths` aligned with it) into batches; see plan_batches."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    min_rows = max(1, max_batch_size // 4)
    for i, t in zip(order, lengths, strict=True):
        new_longest = max(longest, t)
        n = len(current) + 1
        cut = current and (len(current) >= max_batch_size or n * new_longest > target_batch_tokens)
        if not cut and max_padding_waste is not None and len(current) >= min_rows:
            cut = n * new_longest - (real + t) > max_padding_waste * n * new_longest
        if cut:
            batches.append(current)
            current, new_longest, real = [], t, 0
        current.append(i)
        longest = new_longest
        real += t
    if current:
        batches.append(current)
    return batches


def first_batch(lengths: Iterable[int], target_batch_tokens: int, max_batch_size: int,
                max_padding_waste: float | None = None) -> int:
    """How many of the leading rows (in run order) make the next batch; the rule of cut_batches."""
    n = longest = real = 0
    min_rows = max(1, max_batch_size // 4)
    for t in lengths:
        t = max(1, t)
        new_longest = max(longest, t)
        if n and (n >= max_batch_size or (n + 1) * new_longest > target_batch_tokens):
            break
        if max_padding_waste is not None and n >= min_rows and \
                (n + 1) * new_longest - (real + t) > max_padding_waste * (n + 1) * new_longest:
            break
        n, longest, real = n + 1, new_longest, real + t
    return n


def shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (slice compares, not a loop over characters)."""
    lo, hi = 0, min(len(a), len(b))
    if hi > 16 and a[:16] != b[:16]:
        hi = 16  # most unrelated prompts differ early: search only there
    elif a[:hi] == b[:hi]:
        return hi
    hi -= 1
    while lo < hi:  # invariant: a[:lo] == b[:lo], and the answer is at most hi
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def run_order(texts: list[str], tokens: list[int], by_prefix: bool = True, by_length: bool = True) -> list[int]:
    """The order to run a window's rows in: prefix groups (longest prompt first), then longest first.

    A prefix group is a run of prompts, in sorted text order, each sharing at least
    MIN_SHARED_PREFIX leading characters with the one before it.
    """
    n = len(tokens)
    if not by_prefix:  # texts are not needed (and may be left out)
        return sorted(range(n), key=lambda i: -tokens[i]) if by_length else list(range(n))
    group = [0] * n
    by_text = sorted(range(n), key=texts.__getitem__)
    g, prev = -1, ""
    for i in by_text:
        if g < 0 or shared_prefix(prev, texts[i]) < MIN_SHARED_PREFIX:
            g += 1
        group[i] = g
        prev = texts[i]
    first: dict[int, int] = {}
    for i in range(n):
        first.setdefault(group[i], i)
    if by_length:
        # Groups with the longest prompt first (a long sequence started late is the tail that
        # keeps a batch from filling), then longest first inside a group.
        longest: dict[int, int] = {}
        for i in range(n):
            longest[group[i]] = max(longest.get(group[i], 0), tokens[i])
        return sorted(range(n), key=lambda i: (-longest[group[i]], first[group[i]], -tokens[i]))
    return sorted(range(n), key=lambda i: first[group[i]])


class PrefixShare:
    """The share of prompt characters each prompt shares with the one submitted just before it:
    what an engine's prefix cache could reuse had it kept only that prompt."""

    __slots__ = ("shared", "total", "_prev")

    def __init__(self) -> None:
        self.shared = self.total = 0
        self._prev = ""

    def add(self, text: str) -> None:
        self.shared += shared_prefix(self._prev, text)
        self.total += len(text)
        self._prev = text

    @property
    def share(self) -> float:
        return self.shared / self.total if self.total else 0.0
