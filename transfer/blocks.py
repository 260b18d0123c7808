"""Pure page -> block math: which (src, dst, length) blocks move a room's pages, and range checks."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from transfer.base import Block, Region

Run = tuple[int, int, int]  # (first source page, first destination page, number of pages)


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Run]:
    """Pair ``src_pages[i]`` with ``dst_pages[i]`` and merge neighbours that are consecutive on both sides.

    ``merge_runs([4, 5, 6, 9], [10, 11, 3, 4]) == [(4, 10, 2), (6, 3, 1), (9, 4, 1)]``.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[Run] = []
    if not src_pages:
        return runs
    start_src, start_dst, count = src_pages[0], dst_pages[0], 1
    for src, dst in zip(src_pages[1:], dst_pages[1:], strict=True):
        if src == start_src + count and dst == start_dst + count:
            count += 1
        else:
            runs.append((start_src, start_dst, count))
            start_src, start_dst, count = src, dst, 1
    runs.append((start_src, start_dst, count))
    return runs


def kv_blocks(
    src_ptrs: Sequence[int], dst_ptrs: Sequence[int], item_lens: Sequence[int], runs: Sequence[Run]
) -> list[Block]:
    """One block per (buffer, run): buffer ``i`` of both sides, ``item_lens[i]`` bytes per page.

    Buffers are paired by position (K layers then V layers on both sides); blocks come buffer by buffer.
    """
    if not len(src_ptrs) == len(dst_ptrs) == len(item_lens):
        raise ValueError(
            f"buffer lists differ: {len(src_ptrs)} source, {len(dst_ptrs)} destination, {len(item_lens)} items"
        )
    blocks: list[Block] = []
    for src_base, dst_base, item in zip(src_ptrs, dst_ptrs, item_lens, strict=True):
        for src_page, dst_page, count in runs:
            blocks.append((src_base + src_page * item, dst_base + dst_page * item, count * item))
    return blocks


def check_pages(pages: Sequence[int], num_pages: int, what: str) -> None:
    """Raise ValueError naming ``what`` unless every page id is in ``[0, num_pages)``."""
    for page in pages:
        if not 0 <= page < num_pages:
            raise ValueError(f"{what}: page id {page} outside [0, {num_pages})")


class RegionSet:
    """Registered regions with an O(log n) 'does [addr, addr+length) lie inside one region' check."""

    def __init__(self, regions: Sequence[Region]) -> None:
        merged: list[list[int]] = []
        for addr, length in sorted(regions):
            if length <= 0:
                raise ValueError(f"region at {addr:#x} has non-positive length {length}")
            if merged and addr <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], addr + length)
            else:
                merged.append([addr, addr + length])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def __len__(self) -> int:
        return len(self._starts)

    def contains(self, addr: int, length: int) -> bool:
        if length < 0 or addr < 0:
            return False
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + length <= self._ends[i]

    def all_contain(self, blocks: Sequence[tuple[int, int]]) -> bool:
        """Whether every (addr, length) pair lies inside a region."""
        return all(self.contains(addr, length) for addr, length in blocks)
