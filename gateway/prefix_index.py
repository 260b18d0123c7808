"""The gateway's exact prefix-cache index: chained page hash -> the workers holding that page.

Lifecycle (event loop only; nothing here blocks):
1. ``apply(url, events)`` for every ``KVEvents`` frame a worker sends (a ``reset`` snapshot first,
   on each connection); ``drop_worker(url)`` when its connection is lost (a restarted worker comes
   back with an empty cache and a new snapshot); ``forget_worker(url)`` once it has left the fleet:
   its bit is then free for the next new worker, so a fleet whose workers come and go at new
   addresses (pods) keeps its masks as wide as the fleet, not as every address ever seen.
2. ``assume(url, hashes)`` when the gateway routes a request to a prefill: for ``assume_ttl_s`` the
   worker counts as holding the prompt's pages, so a burst of same-prefix requests lands together
   before the worker's events arrive (each routing renews what its events do not cover yet, so a
   prefix kept busy stays where it is). One (mask, expiry) per hash: re-assuming a hash for any
   worker extends it for every worker assumed on it (a heuristic's cheap approximation; the
   events are the truth). Expired entries are ignored by look-ups and swept in bulk; past
   ``MAX_ASSUMED`` live ones, those assumed longest ago go first (a long ``--assume-ttl-s`` at a high
   rate of new prompts kept every one, without bound: ~150 bytes per page, and a lost prefill's
   clean-up passed over them all on the event loop).
3. ``match(hashes)`` -> {url: leading pages held}: the longest run of consecutive hashes per worker
   (a worker serves a prefix only up to its first missing page, as ``PageCache.match`` does).

Workers are bits in an int mask, so a look-up costs one dict probe per matched page plus one step
per worker that drops out, whatever the number of workers.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from workers.protocol import KVEvents

DEFAULT_ASSUME_TTL_S = 2.0
SWEEP_MIN = 4096  # assumed entries kept before the first bulk sweep of expired ones
MAX_ASSUMED = 65_536  # assumed entries kept after a sweep (at most twice that between), oldest dropped first


class PrefixIndex:
    def __init__(self, assume_ttl_s: float = DEFAULT_ASSUME_TTL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.assume_ttl_s = assume_ttl_s
        self._clock = clock  # simulators pass their virtual clock
        self._bit_of: dict[str, int] = {}
        self._urls: list[str | None] = []  # by bit; None: free (``forget_worker``), reused lowest first
        self._free: list[int] = []
        self._held: dict[bytes, int] = {}  # hash -> mask of workers that reported it stored
        self._by_worker: dict[int, set[bytes]] = {}
        self._assumed: dict[bytes, tuple[int, float]] = {}  # hash -> (mask of workers, until), oldest first
        self._assumed_bits = 0  # the workers with assumptions (a worker without any costs no pass over them)
        self._sweep_at = SWEEP_MIN
        self.num_events = 0

    def _bit(self, url: str) -> int:
        bit = self._bit_of.get(url)
        if bit is None:
            if self._free:
                bit = heapq.heappop(self._free)
                self._urls[bit] = url
            else:
                bit = len(self._urls)
                self._urls.append(url)
            self._bit_of[url] = bit
            self._by_worker[bit] = set()
        return bit

    # -- updates ----------------------------------------------------------------------------------
    def apply(self, url: str, events: KVEvents) -> None:
        bit = self._bit(url)
        if events.reset:
            self._clear(bit)
        mask = 1 << bit
        held, mine = self._held, self._by_worker[bit]
        for h in events.removed:
            if h in mine:
                mine.discard(h)
                rest = held[h] & ~mask
                if rest:
                    held[h] = rest
                else:
                    del held[h]
        for h in events.stored:
            if h not in mine:
                mine.add(h)
                held[h] = held.get(h, 0) | mask
        self.num_events += 1

    def drop_worker(self, url: str) -> None:
        """``url``'s connection was lost: what it held and was assumed to hold is gone (a restarted worker
        comes back empty; one that was not sends its snapshot again)."""
        bit = self._bit_of.get(url)
        if bit is not None:
            self._clear(bit)
            self._unassume(bit)

    def forget_worker(self, url: str) -> None:
        """``url`` has left the fleet: drop what it held and was assumed to hold, and free its bit."""
        bit = self._bit_of.pop(url, None)
        if bit is None:
            return
        self._clear(bit)  # (a later worker on this bit must not inherit its pages or assumptions)
        self._unassume(bit)
        del self._by_worker[bit]
        self._urls[bit] = None
        heapq.heappush(self._free, bit)

    def _unassume(self, bit: int) -> None:
        if not self._assumed_bits >> bit & 1:  # (a decode, or a prefill nothing was routed to)
            return
        keep = ~(1 << bit)
        self._assumed = {h: (mask & keep, until) for h, (mask, until) in self._assumed.items() if mask & keep}
        self._assumed_bits &= keep

    def _clear(self, bit: int) -> None:
        """Forget every page the worker on ``bit`` reported holding."""
        keep = ~(1 << bit)
        held = self._held
        for h in self._by_worker[bit]:
            rest = held[h] & keep
            if rest:
                held[h] = rest
            else:
                del held[h]
        self._by_worker[bit] = set()

    def assume(self, url: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        if not hashes or self.assume_ttl_s <= 0:
            return
        now = self._clock() if now is None else now
        until = now + self.assume_ttl_s
        mask = 1 << self._bit(url)
        self._assumed_bits |= mask
        assumed = self._assumed
        for h in hashes:
            entry = assumed.pop(h, None)  # (put back last: the most recently assumed)
            assumed[h] = (mask if entry is None or entry[1] <= now else entry[0] | mask, until)
        if len(assumed) > self._sweep_at:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Expired entries out, and past ``MAX_ASSUMED`` the oldest (so at most twice that many are ever kept:
        the next sweep comes when the entries have doubled)."""
        live = [(h, e) for h, e in self._assumed.items() if e[1] > now]
        self._assumed = dict(live[-MAX_ASSUMED:])  # (oldest first: past the cap, those assumed longest ago go)
        bits = 0
        for mask, _ in self._assumed.values():
            bits |= mask
        self._assumed_bits = bits
        self._sweep_at = max(SWEEP_MIN, 2 * len(self._assumed))

    # -- look-ups ---------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], now: float | None = None) -> dict[str, int]:
        """{url: leading pages held} for every worker holding at least the first page."""
        if not hashes:
            return {}
        now = self._clock() if now is None else now
        held, assumed = self._held, self._assumed
        result: dict[str, int] = {}
        alive = -1  # every worker, until the first page says otherwise
        for depth, h in enumerate(hashes):
            mask = held.get(h, 0)
            entry = assumed.get(h)
            if entry is not None and entry[1] > now:
                mask |= entry[0]
            nxt = alive & mask
            if nxt != alive:
                if depth:
                    self._record(alive & ~nxt, depth, result)
                alive = nxt
                if not alive:
                    return result
        self._record(alive, len(hashes), result)
        return result

    def _record(self, mask: int, depth: int, result: dict[str, int]) -> None:
        urls = self._urls
        while mask:
            low = mask & -mask
            url = urls[low.bit_length() - 1]
            assert url is not None  # (a freed bit is in no mask)
            result[url] = depth
            mask ^= low

    def num_reported(self, url: str, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` the worker reported holding (by its events, not assumed)."""
        bit = self._bit_of.get(url)
        if bit is None:
            return 0
        mine, n = self._by_worker[bit], 0
        for h in hashes:
            if h not in mine:
                break
            n += 1
        return n

    def num_pages(self, url: str) -> int:
        """Pages the worker reported holding (not counting assumptions)."""
        bit = self._bit_of.get(url)
        return len(self._by_worker[bit]) if bit is not None else 0
