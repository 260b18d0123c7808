"""Plain data the scheduler and the transfer layer share: poll states, registered memory, timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import Any


class KVPoll(IntEnum):
    """A room's state. It only moves upward, except that any state may drop to Failed."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class KVArgs:
    """One rank's registered memory.

    ``kv_ptrs`` lists all K layer buffers, then all V layer buffers; ``kv_item_lens[i]`` is the bytes of
    one page of buffer ``i``; ``aux_item_lens[i]`` the bytes of one slot of aux buffer ``i``.
    """

    kv_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    page_size: int
    kv_dtype: str = "float32"

    def __post_init__(self) -> None:
        for prefix, ptrs, lens, items in (
            ("kv", self.kv_ptrs, self.kv_data_lens, self.kv_item_lens),
            ("aux", self.aux_ptrs, self.aux_data_lens, self.aux_item_lens),
        ):
            if not len(ptrs) == len(lens) == len(items):
                raise ValueError(
                    f"KVArgs: {prefix}_ptrs, {prefix}_data_lens and {prefix}_item_lens differ in length "
                    f"({len(ptrs)}, {len(lens)}, {len(items)})"
                )
            for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items, strict=True)):
                if ptr <= 0 or length <= 0 or item <= 0:
                    raise ValueError(f"KVArgs: {prefix} buffer {i} has a non-positive pointer, length or item")
                if length % item:
                    raise ValueError(
                        f"KVArgs: {prefix} buffer {i} length {length} is not a multiple of its item {item}"
                    )
        if not self.kv_ptrs:
            raise ValueError("KVArgs: kv_ptrs is empty")
        if len(self.kv_ptrs) % 2:
            raise ValueError("KVArgs: kv_ptrs must hold K buffers then V buffers (an even count)")
        if self.page_size <= 0:
            raise ValueError(f"KVArgs: page_size must be positive, got {self.page_size}")

    @cached_property  # (read per room; the fields are frozen)
    def num_pages(self) -> int:
        """Pages every KV buffer holds (the smallest buffer counts)."""
        return min(n // item for n, item in zip(self.kv_data_lens, self.kv_item_lens, strict=True))

    @cached_property
    def num_aux_slots(self) -> int:
        if not self.aux_ptrs:
            return 0
        return min(n // item for n, item in zip(self.aux_data_lens, self.aux_item_lens, strict=True))

    @property
    def aux_slot_bytes(self) -> int:
        """Bytes an ``aux`` payload may use: one slot of aux buffer 0 (0 without aux buffers)."""
        return self.aux_item_lens[0] if self.aux_item_lens else 0

    def regions(self) -> list[tuple[int, int]]:
        """Every (address, length) to register: KV buffers, then aux buffers."""
        return [
            *zip(self.kv_ptrs, self.kv_data_lens, strict=True),
            *zip(self.aux_ptrs, self.aux_data_lens, strict=True),
        ]

    @classmethod
    def from_pool(cls, pool: Any) -> KVArgs:
        """Build from a ``workers.kv_pool.KVPool`` (duck-typed, so transfer/ does not import workers/)."""
        aux = pool.aux
        return cls(
            kv_ptrs=pool.kv_ptrs(),
            kv_data_lens=pool.kv_data_lens(),
            kv_item_lens=pool.kv_item_lens(),
            aux_ptrs=[int(aux.ctypes.data)],
            aux_data_lens=[int(aux.nbytes)],
            aux_item_lens=[int(pool.aux_slot_bytes)],
            page_size=int(pool.page_size),
            kv_dtype=str(pool.dtype),
        )


@dataclass(frozen=True)
class KVTimeouts:
    """Deadlines of the control plane, in seconds."""

    bootstrap_s: float = 300.0  # prefill: waiting for the decode's page list; decode: resolve + register
    waiting_s: float = 300.0  # decode: after send_metadata, waiting for KV + status
    transfer_s: float = 60.0  # prefill: a chunk's write still pending this long after it began to be sent -> TIMEOUT
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 6.0  # no frame from a peer for this long -> peer dead, its rooms fail
    # decode, backends that do not fence (mooncake, nixl): a silent prefill's failed rooms keep their pages this long
    # (time the decode ran) waiting for its Quiesced, then are called quiesced anyway and the connection closes;
    # inf: until it answers or dies (never reuse a page a resumed prefill could still write)
    quarantine_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("bootstrap_s", "waiting_s", "transfer_s", "heartbeat_interval_s", "heartbeat_timeout_s",
                     "quarantine_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"KVTimeouts.{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"KVTimeouts.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
