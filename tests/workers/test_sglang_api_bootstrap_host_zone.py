"""A ``bootstrap_host`` that is an IPv6 literal with a zone: ``ipaddress`` takes any text after ``%``, so
``fe80::1%a@evil.com`` passed the 400 check for hosts with credentials, a query or a fragment in them, and the
decode's registry URL ``http://[fe80::1%a@evil.com]:8998/route`` then read ``[fe80::1%a`` as user info and
``evil.com]`` as the host (``#``/``?`` in the zone: an ``httpx.InvalidURL``, which is no ``httpx.HTTPError``).
A zone is an interface name or index, and those stay taken."""

from __future__ import annotations

import pytest

from gateway.api import ClientBootstrap
from gateway.errors import BadRequest
from workers.sglang_api import RelayDispatcher


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("host", ["fe80::1%a@evil.com", "[fe80::1%a@evil.com]", "fe80::1%a#x", "fe80::1%a?x=1",
                                  "fe80::1%a b", "fe80::1%eth0\nforged", "fe80::1%"])
def test_a_zone_that_is_no_interface_is_a_400(role: str, host: str) -> None:
    with pytest.raises(BadRequest) as err:
        RelayDispatcher(None, role).target(ClientBootstrap(host, 8998, 7), 0)  # type: ignore[arg-type]
    assert err.value.param == "bootstrap_host", err.value.message


@pytest.mark.parametrize("host", ["fe80::1%eth0", "fe80::1%2", "fe80::1%enp59s0f0_0", "[fe80::1%br-0123456789ab]"])
def test_interface_zones_are_taken(host: str) -> None:
    target = RelayDispatcher(None, "decode").target(ClientBootstrap(host, 8998, 7), 0)  # type: ignore[arg-type]
    assert target is not None and target.host == host.strip("[]")
