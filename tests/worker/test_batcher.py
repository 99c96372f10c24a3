"""Batching: sorted token-budget batches, every row once, and results restored to input order."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from bij.local.publish import publish_manifest
from bij.worker.batcher import plan_batches
from bij.worker.reader import Line, Prefetcher


def test_batches_hold_every_row_once_within_the_padded_budget():
    rnd = random.Random(2)
    for _ in range(300):
        tokens = [rnd.choice([0, 1, 2, 5, 30, 200, 5000]) for _ in range(rnd.randint(0, 60))]
        budget, max_size = rnd.choice([1, 10, 100, 1000, 4096]), rnd.randint(1, 20)
        for sort in (True, False):
            batches = plan_batches(tokens, budget, max_size, sort)
            assert sorted(i for b in batches for i in b) == list(range(len(tokens)))
            for b in batches:
                assert 1 <= len(b) <= max_size
                padded = len(b) * max(max(1, tokens[i]) for i in b)
                assert padded <= budget or len(b) == 1  # a row over the budget runs alone
            order = [i for b in batches for i in b]
            if sort:
                assert [tokens[i] for i in order] == sorted(tokens, reverse=True)
            else:
                assert order == list(range(len(tokens)))


def test_sorted_batches_waste_less_padding_than_input_order():
    rnd = random.Random(4)
    tokens = [rnd.choice([4, 8, 500]) for _ in range(400)]

    def padded(batches: list[list[int]]) -> int:
        return sum(len(b) * max(tokens[i] for i in b) for b in batches)

    assert padded(plan_batches(tokens, 4000, 64, True)) < padded(plan_batches(tokens, 4000, 64, False)) / 2


@pytest.mark.parametrize("sort", [True, False])
def test_results_come_back_in_input_order_whatever_order_the_engine_ran(sort, file_place, make_job, run_shards,
                                                                        recording_echo, read_output):
    rnd = random.Random(9)
    rows = [{"id": i, "text": f"{i}:" + "z" * rnd.choice([0, 3, 17, 90, 700, 2500])} for i in range(300)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      sharding={"chunkRows": 64, "targetShardBytes": 1 << 20},
                      batching={"sortByLength": sort, "targetBatchTokens": 2000, "maxBatchSize": 16})
    engine = recording_echo()
    run_shards(job, engine=engine)
    publish_manifest(job)
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["text"]) for r in rows]
    ran = engine.seen
    assert sorted(ran) == sorted(r["text"] for r in rows)
    # The engine really ran them in another order (longest first within each chunk) when sorting.
    assert (ran != [r["text"] for r in rows]) == sort
    assert len(engine.batches) > 300 // 16


def lines(n: int, consumed: list[int]) -> Iterator[Line]:
    for i in range(n):
        consumed.append(i)
        yield (0, i * 10, i * 10 + 10), b"x" * 9


def test_prefetch_reads_ahead_at_most_depth_chunks():
    consumed: list[int] = []
    pre = Prefetcher(lines(10_000, consumed), chunk_rows=10, depth=2)
    chunks = iter(pre)
    first = next(chunks)
    time.sleep(0.3)  # the reader thread has had every chance to run ahead
    # The chunk in hand, `depth` waiting in the queue, and one being filled while the put blocks.
    assert len(first.lines) == 10 and len(consumed) <= 10 * (1 + 2 + 1)
    rest = [c for c in chunks]
    assert sum(len(c.lines) for c in rest) == 10_000 - 10
    assert [c.lines[0][0][1] for c in rest[:2]] == [100, 200]
    pre.close()


def test_prefetch_hands_a_read_error_to_the_consumer_and_close_stops_the_reader():
    def failing() -> Iterator[Line]:
        yield (0, 0, 2), b"a"
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(Prefetcher(failing(), chunk_rows=1, depth=1))

    consumed: list[int] = []
    pre = Prefetcher(lines(10_000, consumed), chunk_rows=10, depth=1)
    next(iter(pre))
    pre.close()
    time.sleep(0.5)
    stopped_at = len(consumed)
    time.sleep(0.3)
    assert len(consumed) == stopped_at < 10_000
    assert not pre._thread.is_alive()


def test_padding_waste_cap_cuts_a_batch_before_short_rows_pad_to_a_long_one():
    from bij.worker.batcher import plan_batches

    tokens = [100] * 8 + [10] * 8
    assert plan_batches(tokens, 10_000, 16) == [list(range(16))]
    capped = plan_batches(tokens, 10_000, 16, max_padding_waste=0.2)
    # Two short rows pad 180 of 1000 tokens (18%); a third would make it 270 of 1100 (25%).
    assert capped == [list(range(10)), list(range(10, 16))]
    # Small batches (under a quarter of the size) are never cut for waste alone.
    assert plan_batches([100, 10, 10], 10_000, 16, max_padding_waste=0.2) == [[0, 1, 2]]


def test_run_order_groups_shared_prefixes_first_seen_first_then_longest_first():
    from bij.worker.batcher import MIN_SHARED_PREFIX, run_order

    a, b = "A" * MIN_SHARED_PREFIX, "B" * MIN_SHARED_PREFIX
    texts = [b + "x", a + "xyz", "The cat", b + "xyz", a + "x", "The dog sat"]
    tokens = [len(t) for t in texts]
    order = run_order(texts, tokens)
    assert order == [3, 0, 1, 4, 2, 5] or order == [3, 0, 1, 4, 5, 2]
    assert [texts[i][0] for i in order[:4]] == ["B", "B", "A", "A"]
    assert run_order(texts, tokens, by_prefix=False) == sorted(range(6), key=lambda i: -tokens[i])
    assert sorted(run_order(texts, tokens, by_length=False)) == list(range(6))


def test_prefix_share_counts_characters_shared_with_the_prompt_before():
    from bij.worker.batcher import PrefixShare, shared_prefix

    assert shared_prefix("system: be brief. q1", "system: be brief. q2") == 19
    assert shared_prefix("abc", "abc") == 3 and shared_prefix("", "x") == 0
    share = PrefixShare()
    for text in ("aaaa1", "aaaa2", "bbbb1"):
        share.add(text)
    assert (share.shared, share.total) == (4, 15)


def test_first_batch_cuts_where_plan_batches_does():
    from bij.worker.batcher import cut_batches, first_batch

    rnd = random.Random(8)
    for _ in range(300):
        lengths = sorted((rnd.choice([1, 3, 8, 40, 300]) for _ in range(rnd.randint(1, 50))), reverse=True)
        budget, size = rnd.choice([10, 100, 1000, 10_000]), rnd.randint(1, 20)
        waste = rnd.choice([None, 0.2])
        batches = cut_batches(lengths, list(range(len(lengths))), budget, size, waste)
        assert first_batch(lengths, budget, size, waste) == len(batches[0])
