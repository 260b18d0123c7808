"""Backends are found by entry point name or ``module:attr``; bad plugins fail with a clear error."""

from __future__ import annotations

import pytest

from transfer import TransferBackend, available_backends, create_backend
from transfer.fake import FakeBackend
from transfer.tcp import TcpBackend


class NotABackend:
    pass


def test_builtins_by_name():
    assert {"tcp", "fake", "mooncake", "nixl"} <= set(available_backends())
    fake = create_backend("fake")
    assert isinstance(fake, FakeBackend) and fake.name == "fake"
    tcp = create_backend("tcp", host="127.0.0.1")
    try:
        assert isinstance(tcp, TcpBackend) and tcp.endpoint().startswith(b"127.0.0.1:")
    finally:
        tcp.close()


def test_module_attr():
    backend = create_backend("transfer.fake:FakeBackend")
    assert isinstance(backend, TransferBackend)


def test_errors_name_the_plugin():
    with pytest.raises(ValueError, match=r"unknown transfer backend plugin 'nope'; available: .*tcp"):
        create_backend("nope")
    with pytest.raises(ValueError, match=r"plugin 'no.such.module:X': cannot import no.such.module"):
        create_backend("no.such.module:X")
    with pytest.raises(ValueError, match=r"has no 'Missing'"):
        create_backend("transfer.fake:Missing")
    with pytest.raises(ValueError, match=r"plugin 'fake': bad options \['color'\]"):
        create_backend("fake", color="blue")
    with pytest.raises(ValueError, match=r"built NotABackend, not a TransferBackend"):
        create_backend(f"{__name__}:NotABackend")
