"""A registrar whose ``start()`` ends before its PUT was answered (cancelled: the worker was stopped while starting;
or given up: ``start_timeout_s`` ran out on a slow registry) says goodbye all the same.

That PUT may still reach the registry (a slow or loaded registry, a proxy holding it) and register the prefill; the
registrar used to close its client without a word (``aclose`` then had nothing to say goodbye with), leaving a ghost
entry that decodes look up at a dead address until its lease lapses, for ever with ``--ttl-s 0``. Now it sends the
goodbye, and the registry's tombstone for its ``registrant`` refuses the late PUT (410 ``deregistered``).

The registry is a real process; the holding proxy of ``test_goodbye_is_final`` holds the first PUT back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from conftest import RegistryProc, topology
from test_goodbye_is_final import HANG_GUARD_S, HoldingProxy, _ranks, _registration

from bootstrap import BootstrapError, BootstrapRegistrar


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
def test_a_start_cut_short_leaves_no_ghost_entry(start_registry: Callable[..., RegistryProc], how: str) -> None:
    reg = start_registry("--ttl-s", "0")  # (no leases: a ghost would stay for ever)

    async def run() -> None:
        proxy = HoldingProxy(reg.port, hold_put=1)  # (the first registration PUT)
        await proxy.start()
        try:
            # (interval 0.05 s: the client's timeout is its minimum, 1 s)
            registrar = BootstrapRegistrar(proxy.url, _registration(instance_id="c", registrant="starter"),
                                           interval_s=0.05, start_timeout_s=0.5 if how == "timed_out" else 60)
            starting = asyncio.create_task(registrar.start())
            await asyncio.wait_for(proxy.held.wait(), HANG_GUARD_S)
            if how == "cancelled":  # (SIGTERM while the prefill starts: the worker's start task is cancelled)
                starting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(starting, HANG_GUARD_S)
            else:  # (the PUT times out after 1 s, past the 0.5 s start-up budget)
                with pytest.raises(BootstrapError):
                    await asyncio.wait_for(starting, HANG_GUARD_S)
            await asyncio.wait_for(registrar.aclose(), HANG_GUARD_S)  # (the worker's clean-up)
            proxy.release()  # the registration reaches the registry now, after the registrar has gone
            await asyncio.wait_for(proxy.held_forwarded.wait(), HANG_GUARD_S)
        finally:
            await proxy.aclose()
        assert topology(reg.url, "c").status_code == 503, f"a ghost entry: {_ranks(reg)} ({proxy.forwarded})"
        assert proxy.held_status == 410

    asyncio.run(run())


def test_a_start_that_timed_out_may_be_tried_again_until_aclose(start_registry: Callable[..., RegistryProc]) -> None:
    """(The goodbye is ``aclose``'s: a caller retrying ``start()`` after a ``BootstrapError`` is not refused 410)"""
    reg = start_registry("--ttl-s", "0")

    async def run() -> None:
        proxy = HoldingProxy(reg.port, hold_put=1)
        await proxy.start()
        try:
            registrar = BootstrapRegistrar(proxy.url, _registration(instance_id="t", registrant="retrier"),
                                           interval_s=0.05, start_timeout_s=0.5)
            with pytest.raises(BootstrapError):
                await asyncio.wait_for(registrar.start(), HANG_GUARD_S)
            registrar.start_timeout_s = HANG_GUARD_S
            await asyncio.wait_for(registrar.start(), HANG_GUARD_S)  # (its 2nd PUT goes through)
            assert topology(reg.url, "t").status_code == 200
            await asyncio.wait_for(registrar.aclose(), HANG_GUARD_S)
            proxy.release()  # the first PUT lands after the goodbye
            await asyncio.wait_for(proxy.held_forwarded.wait(), HANG_GUARD_S)
        finally:
            await proxy.aclose()
        assert topology(reg.url, "t").status_code == 503, f"a ghost entry: {_ranks(reg)} ({proxy.forwarded})"
        assert proxy.held_status == 410

    asyncio.run(run())
