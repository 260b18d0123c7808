"""Helpers shared by the transfer unit tests (a plain module: conftest names collide across test dirs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transfer import KVArgs
from workers.kv_pool import KVPool

_POOLS: list[KVPool] = []  # keep registered memory alive for the whole test session


def make_args(**changes: Any) -> KVArgs:
    """A small pool's KVArgs: 2 layers, 16 pages of 4 tokens, 4 aux slots of 32 bytes."""
    pool = KVPool(num_layers=2, num_pages=16, page_size=4, num_kv_heads=1, head_dim=4, num_aux_slots=4,
                  aux_slot_bytes=32)
    _POOLS.append(pool)
    args = KVArgs.from_pool(pool)
    return KVArgs(**{**args.__dict__, **changes}) if changes else args


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return predicate()
