"""A round's input cut into shards from object sizes alone (pure: O(objects + shards)), the shard size a
round is cut to, and how many lanes its Job runs."""

from __future__ import annotations

from bij.contract.spec import BatchInferenceJob

Piece = tuple[int, int, int]  # (object index, start, end)


def plan_shards(sizes: list[tuple[int, bool]], target_bytes: int,
                groups: dict[int, list[int]] | None = None, whole: bool = False) -> list[list[Piece]]:
    """Shards for objects given as (size, compressed), in object order. Pure and O(objects + shards).

    An object in `groups` (Parquet: the compressed bytes of each row group) is cut between
    row groups, and its pieces are ``[object, first group, end group)``. With `whole`
    (output.partitionBy input) no object is cut: each is one piece of one shard.
    """
    if whole:
        whole_groups = {i: [sum(g)] for i, g in (groups or {}).items()}
        cut = plan_shards([(size, True) for size, _ in sizes], target_bytes, whole_groups)
        # A Parquet object's one piece spans all its row groups.
        return [[(i, 0, len(groups[i])) if groups and i in groups else (i, a, b) for i, a, b in shard]
                for shard in cut]
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    fill = 0
    for idx, (size, compressed) in enumerate(sizes):
        if size <= 0:
            continue
        if groups is not None and idx in groups:
            start = 0
            for g, group_bytes in enumerate(groups[idx]):
                if fill > 0 and fill + group_bytes > target_bytes:
                    if g > start:
                        current.append((idx, start, g))
                    shards.append(current)
                    current, fill, start = [], 0, g
                fill += group_bytes
            if len(groups[idx]) > start:
                current.append((idx, start, len(groups[idx])))
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
            continue
        if compressed:
            if current and fill + size > target_bytes:
                shards.append(current)
                current, fill = [], 0
            current.append((idx, 0, size))
            fill += size
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
            continue
        offset = 0
        while offset < size:
            take = min(size - offset, target_bytes - fill)
            current.append((idx, offset, offset + take))
            offset += take
            fill += take
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
    if current:
        shards.append(current)
    return shards


def round_target_bytes(job: BatchInferenceJob, round_no: int, total_bytes: int) -> int:
    """Shard size for a round: at most targetShardBytes, and small enough for `shardsPerLane`
    shards per lane, so the shards still running at a round's end are short and a lane that
    is done takes over the rest; never below minShardBytes (or targetShardBytes, if smaller).
    A judge round after the first, holding only the rows rejected before, is cut the same way."""
    sharding = job.spec.sharding
    target = sharding.target_shard_bytes
    share = -(-total_bytes // (sharding.shards_per_lane * job.spec.workers.parallelism))
    return max(min(target, sharding.min_shard_bytes), min(target, share))


def lanes_for(job: BatchInferenceJob, shards: int) -> int:
    """The round Job's indexes: workers.parallelism, never more than there are shards."""
    return min(job.spec.workers.parallelism, shards)
