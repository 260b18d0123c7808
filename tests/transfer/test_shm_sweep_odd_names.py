"""A hidden file in the shared-memory directory whose name holds no pid we can signal (``.pd-kv-pool-<20 digits>-x``,
a superscript digit: any local user may create one in /dev/shm, or a tool left it) is not swept, and does not stop
the sweep: ``os.kill`` raised OverflowError, ``int`` ValueError, out of ``sweep_stale`` and so out of every
``SharedFile.create``, and no worker could make its KV pool or fence board."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from transfer.shm_files import SharedFile, sweep_stale


@pytest.mark.parametrize("pid", ["99999999999999999999", "\u00b2"], ids=["overflow", "superscript"])
def test_an_odd_hidden_name_neither_breaks_the_sweep_nor_a_create(tmp_path: Path, pid: str) -> None:
    odd = tmp_path / f".pd-kv-pool-{pid}-0011223344556677"
    odd.write_bytes(b"x")
    stale = tmp_path / "pd-kv-pool-1-0011223344556677"  # an ordinary file of a dead owner: still swept
    stale.write_bytes(b"x")
    assert sweep_stale(str(tmp_path), "pd-kv-pool-") == 1
    assert odd.exists() and not stale.exists()
    shared = SharedFile.create("pd-kv-pool-", 4096, str(tmp_path))
    try:
        assert os.path.exists(shared.path)
    finally:
        shared.close()
