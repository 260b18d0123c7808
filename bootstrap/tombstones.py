"""Goodbyes the registry remembers: a rank's registrant that sent ``DELETE /route`` may not register it again.

A renewal PUT the registrar sent (or cancelled) before its goodbye can reach the registry after it (a slow
connection, a proxy, a loaded server); registered, it would bring a dead prefill back until its lease ends (for
ever with ``--ttl-s 0``), and decodes would look their rooms up there. Lifecycle (the registry's event loop only;
nothing blocks):
1. ``bury(key, now)`` on a goodbye that names its ``registrant``: the key (instance id, rank, registrant) is
   refused until ``now + lifetime_s``. At most ``max_count`` are kept; beyond that the oldest goes first.
2. ``is_buried(key, now)`` on a PUT that names a ``registrant`` (an unmarked one, SGLang's, is never looked up:
   nothing tells its process from the next one on the same address).
3. ``sweep(now)`` forgets the expired ones (the registry's sweeper; ``is_buried`` also ignores them).
A tombstone keeps a 16-byte digest of the registrant, not the string as sent (up to the PUT's 4 KiB of extra
fields): ``max_count`` of them stay within a few MiB.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

RankKey = tuple[int, int, int, int]  # (dp_group, cp_rank, tp_rank, pp_rank)
TombstoneKey = tuple[str, RankKey, str]  # (instance id, rank, registrant)
_StoredKey = tuple[str, RankKey, bytes]  # (instance id, rank, the registrant's digest)


def _stored(key: TombstoneKey) -> _StoredKey:
    instance_id, rank, registrant = key
    return instance_id, rank, hashlib.blake2b(registrant.encode(errors="surrogatepass"), digest_size=16).digest()


class Tombstones:
    """Per (instance, rank, registrant) goodbyes, each refused for ``lifetime_s`` (see the module docstring)."""

    def __init__(self, *, lifetime_s: float, max_count: int) -> None:
        if lifetime_s < 0 or max_count < 1:
            raise ValueError(f"lifetime_s must be >= 0 and max_count >= 1, got {lifetime_s}, {max_count}")
        self.lifetime_s = lifetime_s
        self.max_count = max_count
        # key -> until when (monotonic); insertion order is expiry order, as every one lives ``lifetime_s``
        self._until: OrderedDict[_StoredKey, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def __bool__(self) -> bool:
        return bool(self._until)

    def bury(self, key: TombstoneKey, now: float) -> None:
        stored = _stored(key)
        self._until.pop(stored, None)  # (inserted again last: its expiry is now the newest)
        self._until[stored] = now + self.lifetime_s
        while len(self._until) > self.max_count:
            self._until.popitem(last=False)

    def is_buried(self, key: TombstoneKey, now: float) -> bool:
        until = self._until.get(_stored(key))
        if until is None:
            return False
        if until <= now:
            self.sweep(now)
            return False
        return True

    def sweep(self, now: float) -> int:
        """Forget the expired ones; returns how many."""
        num = 0
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[key]
            num += 1
        return num
