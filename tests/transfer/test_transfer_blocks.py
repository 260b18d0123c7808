"""Page -> block math: examples, property-style random checks, region checks."""

from __future__ import annotations

import itertools
import random

import pytest

from transfer.blocks import RegionSet, check_pages, kv_blocks, merge_runs


def test_merge_runs_examples():
    assert merge_runs([], []) == []
    assert merge_runs([4], [9]) == [(4, 9, 1)]
    assert merge_runs([4, 5, 6, 9], [10, 11, 3, 4]) == [(4, 10, 2), (6, 3, 1), (9, 4, 1)]
    assert merge_runs([0, 1, 2, 3], [7, 8, 9, 10]) == [(0, 7, 4)]
    # consecutive on one side only: no merge
    assert merge_runs([0, 1, 2], [5, 7, 9]) == [(0, 5, 1), (1, 7, 1), (2, 9, 1)]
    assert merge_runs([3, 2, 1], [1, 2, 3]) == [(3, 1, 1), (2, 2, 1), (1, 3, 1)]
    with pytest.raises(ValueError, match="3 source pages but 2"):
        merge_runs([1, 2, 3], [1, 2])


@pytest.mark.parametrize("seed", range(200))
def test_merge_runs_properties(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    # mostly-consecutive page lists, like a real allocator after some churn
    src = sorted(rng.sample(range(200), n)) if rng.random() < 0.5 else rng.sample(range(200), n)
    base = rng.randint(0, 100)
    dst = [base + i if rng.random() < 0.7 else rng.randint(0, 300) for i in range(n)]
    runs = merge_runs(src, dst)
    # 1. the runs expand back to exactly the pairs, in order
    pairs = [(s + k, d + k) for s, d, count in runs for k in range(count)]
    assert pairs == list(zip(src, dst, strict=True))
    # 2. runs are maximal: two neighbours never continue each other on both sides
    for (s1, d1, c1), (s2, d2, _) in itertools.pairwise(runs):
        assert not (s2 == s1 + c1 and d2 == d1 + c1)
    assert all(count >= 1 for _, _, count in runs)


def test_kv_blocks_addresses_per_buffer():
    runs = [(2, 5, 3), (9, 0, 1)]
    blocks = kv_blocks([1000, 2000], [50_000, 60_000], [10, 20], runs)
    assert blocks == [
        (1000 + 20, 50_000 + 50, 30), (1000 + 90, 50_000, 10),
        (2000 + 40, 60_000 + 100, 60), (2000 + 180, 60_000, 20),
    ]
    with pytest.raises(ValueError, match="buffer lists differ"):
        kv_blocks([1], [1, 2], [1], runs)


@pytest.mark.parametrize("seed", range(50))
def test_kv_blocks_cover_every_page_once(seed):
    rng = random.Random(seed)
    item, n_buf, n = rng.choice([16, 256, 4096]), rng.randint(1, 8), rng.randint(1, 40)
    src, dst = rng.sample(range(100), n), rng.sample(range(100), n)
    src_ptrs = [10**9 * (b + 1) for b in range(n_buf)]
    dst_ptrs = [10**12 * (b + 1) for b in range(n_buf)]
    blocks = kv_blocks(src_ptrs, dst_ptrs, [item] * n_buf, merge_runs(src, dst))
    assert sum(length for _, _, length in blocks) == n_buf * n * item
    covered = set()
    for s, d, length in blocks:
        b = s // 10**9 - 1
        for k in range(length // item):
            covered.add((b, (s - src_ptrs[b]) // item + k, (d - dst_ptrs[b]) // item + k))
    assert covered == {(b, sp, dp) for b in range(n_buf) for sp, dp in zip(src, dst, strict=True)}


def test_check_pages():
    check_pages([0, 5, 9], 10, "x")
    with pytest.raises(ValueError, match="room 3: page id 10 outside"):
        check_pages([1, 10], 10, "room 3")
    with pytest.raises(ValueError, match="-1"):
        check_pages([-1], 10, "x")


def test_region_set():
    regions = RegionSet([(100, 50), (300, 10), (140, 20)])  # overlapping ones merge
    assert len(regions) == 2
    assert regions.contains(100, 60) and regions.contains(150, 10) and regions.contains(300, 10)
    assert regions.contains(309, 1) and regions.contains(100, 0)
    assert not regions.contains(99, 2) and not regions.contains(155, 10) and not regions.contains(305, 6)
    assert not regions.contains(200, 1) and not regions.contains(-5, 1) and not regions.contains(110, -1)
    assert not regions.contains(150, 160)  # spans a gap
    assert regions.all_contain([(100, 1), (300, 2)]) and not regions.all_contain([(100, 1), (0, 1)])
    assert not RegionSet([]).contains(0, 0)
    with pytest.raises(ValueError, match="non-positive"):
        RegionSet([(1, 0)])
