"""The registry's goodbye tombstones stay small whatever a ``registrant`` is: 16,384 of them (``MAX_TOMBSTONES``) are
documented at ~300 bytes each, but each kept the registrant string as sent, up to the 4 KiB the PUT's extra fields may
hold, and a ``DELETE /route`` buries one also when no such entry exists: ~70 MiB held for a minute by DELETEs alone."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest
from conftest import rank_body

from bootstrap.errors import ApiError
from bootstrap.messages import RankPut
from bootstrap.registry import MAX_TOMBSTONES, Registry


def put(**kw: Any) -> RankPut:
    return msgspec.convert(rank_body(**kw), RankPut)


def _registrant(n: int) -> str:
    return f"{n}-".ljust(4000, "r")  # (within the PUT's MAX_EXTRA_BYTES)


def test_tombstones_of_long_registrants_stay_small() -> None:
    reg = Registry(ttl_s=10, max_ranks=10)
    goodbye = put(instance_id="p")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(MAX_TOMBSTONES):  # (each one decoded from its own request, as the registry's are)
            reg.deregister(goodbye, now=0.0, extra={"registrant": _registrant(n)})
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(reg.tombstones) == MAX_TOMBSTONES
    assert held < 16 * 2**20, f"{MAX_TOMBSTONES} tombstones hold {held / 2**20:.1f} MiB"
    # (still told apart: each one's PUT is refused, another registrant's is not)
    with pytest.raises(ApiError) as refused:
        reg.register(put(instance_id="p"), {"registrant": _registrant(MAX_TOMBSTONES - 1)}, now=1.0)
    assert refused.value.status == 410
    reg.register(put(instance_id="p"), {"registrant": _registrant(MAX_TOMBSTONES)}, now=1.0)
