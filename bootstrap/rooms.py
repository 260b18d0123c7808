"""Room -> prefill DP rank table behind ``/register_dp_rank`` and ``/query_dp_ranks``.

Lifecycle (single event loop, nothing blocks):
1. A prefill whose DP dispatch does not follow ``room % dp_size`` calls ``register(room, dp_rank)``
   when it accepts a request; the entry lives ``ttl_s`` (re-registering renews it).
2. A decode calls ``query(rooms)`` and gets ``{str(room): dp_rank}`` for the live rooms only
   (SGLang's reply shape: string keys, unknown rooms simply absent).
3. ``sweep(now)`` drops expired entries in O(expired): the table is kept in expiry order (the TTL is
   one constant, so a new or renewed entry expires last and goes to the end), and its size is bounded
   by ``max_rooms`` however often a room is renewed.
"""

from __future__ import annotations

from collections import OrderedDict

from bootstrap import errors

MAX_ROOM = (1 << 64) - 1
MAX_DP_RANK = 65_535


class RoomTable:
    def __init__(self, *, ttl_s: float, max_rooms: int) -> None:
        self._ttl_s = ttl_s
        self._max_rooms = max_rooms
        self._rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()  # room -> (dp_rank, expires_at), soonest first
        self.num_expirations = 0

    def __len__(self) -> int:
        return len(self._rooms)

    def register(self, room: int, dp_rank: int, now: float) -> None:
        if not 0 <= room <= MAX_ROOM:
            raise errors.bad_request("invalid_field", f"bootstrap_room must be in [0, 2^64), got {room}")
        if not 0 <= dp_rank <= MAX_DP_RANK:
            raise errors.bad_request("invalid_field", f"dp_rank must be in [0, {MAX_DP_RANK}], got {dp_rank}")
        if room not in self._rooms and len(self._rooms) >= self._max_rooms:
            self.sweep(now)
            if len(self._rooms) >= self._max_rooms:
                raise errors.unavailable("room_table_full", f"room table holds the maximum of {self._max_rooms}")
        self._rooms[room] = (dp_rank, now + self._ttl_s)
        self._rooms.move_to_end(room)

    def query(self, rooms: list[int], now: float) -> dict[str, int]:
        found: dict[str, int] = {}
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None and entry[1] > now:
                found[str(room)] = entry[0]
        return found

    def sweep(self, now: float) -> int:
        dropped = 0
        rooms = self._rooms
        while rooms:
            room, (_, expires_at) = next(iter(rooms.items()))
            if expires_at > now:
                break
            del rooms[room]
            dropped += 1
        self.num_expirations += dropped
        return dropped
