"""``workers.addresses.advertised_host``: what a worker tells its peers, and the start-up errors."""

from __future__ import annotations

import pytest

from workers.addresses import AddressError, advertised_host


def test_specific_host_is_advertised() -> None:
    assert advertised_host("127.0.0.1", None, None) == "127.0.0.1"
    assert advertised_host("127.0.0.1", "127.0.0.1", "http://127.0.0.1:8998") == "127.0.0.1"
    assert advertised_host("localhost", None, None) in ("127.0.0.1", "::1")


def test_wildcard_host_advertises_the_route_to_the_registry() -> None:
    assert advertised_host("0.0.0.0", None, "http://127.0.0.1:8998") == "127.0.0.1"  # (a one-host setup)
    assert advertised_host("0.0.0.0", "127.0.0.1", None) == "127.0.0.1"


@pytest.mark.parametrize(("host", "advertise", "registry", "needle"), [
    ("192.0.2.7", None, None, "not an address of this machine"),
    ("127.0.0.1", "127.0.0.2", None, "does not match --host"),
    ("0.0.0.0", "0.0.0.0", None, "not a wildcard"),
    ("0.0.0.0", "192.0.2.7", None, "not an address of this machine"),
    ("0.0.0.0", "no-such-host.invalid", None, "does not resolve"),
    ("127.0.0.1", None, "http://192.0.2.8:8998", "loopback"),
])
def test_unusable_combinations(host: str, advertise: str | None, registry: str | None, needle: str) -> None:
    with pytest.raises(AddressError, match=needle):
        advertised_host(host, advertise, registry)


def test_no_route_and_only_loopback_means_loopback() -> None:
    import socket

    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        pytest.skip("needs a network namespace holding only loopback (make pytest)")
    assert advertised_host("0.0.0.0", None, None) == "127.0.0.1"
