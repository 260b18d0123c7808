"""BootstrapResolver while the registry is down (found by the chaos runner, loadtests/chaos.py).

Before: once a cached reply expired (``cache_ttl_s``, 5 s), a registry that did not answer failed every
decode room whose prefill had not been looked up in the last seconds, although the prefill had not
moved; a registry restart cost every such request a 502. Now an expired reply still answers while
the registry does not, or while it answers that the instance is not registered (restarted empty, until
the prefill's next heartbeat), for ``stale_if_unreachable_s``; once the caller has invalidated an
address (its connection failed), the registry's answer is final.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import RegistryProc, rank_body

from bootstrap import BootstrapNotReady, BootstrapResolver, BootstrapUnreachable


def test_an_expired_reply_answers_while_the_registry_is_down(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="p", rank_port=52100), timeout=5)
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="r", rank_port=52101), timeout=5)
    resolver = BootstrapResolver(cache_ttl_s=0.2, timeout_s=2)
    strict = BootstrapResolver(cache_ttl_s=0.2, timeout_s=2, stale_if_unreachable_s=0)
    try:
        for r in (resolver, strict):
            assert r.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
            assert r.topology("127.0.0.1", reg.port, "p").page_size == 16
        assert resolver.resolve("127.0.0.1", reg.port, "r") == ("127.0.0.1", 52101)
        reg.stop(signal.SIGKILL)
        time.sleep(0.3)  # both replies expired
        assert resolver.cached_address("127.0.0.1", reg.port, "p") is None, "expired: the fast path asks"
        assert resolver.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
        assert resolver.topology("127.0.0.1", reg.port, "p").page_size == 16
        with pytest.raises(BootstrapUnreachable):
            strict.resolve("127.0.0.1", reg.port, "p")
        with pytest.raises(BootstrapUnreachable):
            resolver.resolve("127.0.0.1", reg.port, "never-seen")
        resolver.invalidate("127.0.0.1", reg.port, "p")  # its address failed: nothing stale to offer
        with pytest.raises(BootstrapUnreachable):
            resolver.resolve("127.0.0.1", reg.port, "p")

        assert resolver.resolve("127.0.0.1", reg.port, "r") == ("127.0.0.1", 52101)
        reg.start()  # back and empty until the prefill's next heartbeat: its cached address still answers
        assert resolver.resolve("127.0.0.1", reg.port, "r") == ("127.0.0.1", 52101)
        with pytest.raises(BootstrapNotReady):
            strict.resolve("127.0.0.1", reg.port, "r")
        resolver.invalidate("127.0.0.1", reg.port, "r")  # (the caller's connect failed: the registry decides)
        with pytest.raises(BootstrapNotReady):
            resolver.resolve("127.0.0.1", reg.port, "r")
    finally:
        resolver.close()
        strict.close()


def test_only_an_unregistered_instance_gets_its_cached_address() -> None:
    """A registry restarted empty answers not_registered (the prefill re-registers at its next heartbeat);
    not_ready means it is half registered or lost a rank: that answer is believed."""
    from bootstrap.client import _may_be_stale

    assert _may_be_stale(BootstrapUnreachable("down"))
    assert _may_be_stale(BootstrapNotReady("empty", status_code=503, code="not_registered"))
    assert not _may_be_stale(BootstrapNotReady("half", status_code=503, code="not_ready"))
    assert not _may_be_stale(BootstrapNotReady("no code", status_code=503))


def test_a_frozen_registry_is_asked_again_only_after_a_while(start_registry: Callable[..., RegistryProc]) -> None:
    """A registry that takes connections but never answers (frozen, or a partition dropping packets) costs a
    look-up its whole timeout: the expired reply it then serves answers the next look-ups of that key
    without asking, for as long as a fresh reply would, and a registry back again is asked after that."""
    reg = start_registry("--ttl-s", "0")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="p", rank_port=52100), timeout=5)
    resolver = BootstrapResolver(cache_ttl_s=0.3, timeout_s=0.5)
    asked = []
    real_get = resolver._get

    def counting_get(*args: object) -> object:
        asked.append(args)
        return real_get(*args)  # type: ignore[arg-type]

    resolver._get = counting_get  # type: ignore[method-assign]
    assert reg.proc is not None
    try:
        assert resolver.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
        reg.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.35)  # expired
        assert resolver.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)  # (after the timeout)
        assert len(asked) == 2
        for _ in range(5):
            assert resolver.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
        assert len(asked) == 2, "the frozen registry was asked again at once"
        reg.proc.send_signal(signal.SIGCONT)
        time.sleep(0.35)
        assert resolver.resolve("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
        assert len(asked) == 3  # (asked again, and answered: fresh from here)
        assert resolver.cached_address("127.0.0.1", reg.port, "p") == ("127.0.0.1", 52100)
    finally:
        if reg.proc.poll() is None:
            reg.proc.send_signal(signal.SIGCONT)
        resolver.close()
