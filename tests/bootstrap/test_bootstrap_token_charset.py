"""Review: a bearer token that no HTTP client can send.

``BootstrapConfig`` refused only an empty token and whitespace, so ``pd-bootstrap --token 's3crét'`` (or one
with a control character) started and served, while its clients cannot present that token: httpx encodes
header values as ASCII, so a prefill's ``BootstrapRegistrar.start()`` died with a bare ``UnicodeEncodeError``
(not a ``BootstrapError`` naming the flag), and a control character made the request unparsable, which the
registrar reported as the registry refusing the rank ("HTTP 400: Invalid HTTP request received"). The
registry's flags are validated at start-up (exit 2 naming the field), and so must the clients' token be:
at construction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from conftest import RegistryProc

from bootstrap import BootstrapConfig, BootstrapError
from bootstrap.cli import parse_args
from bootstrap.client import BootstrapRegistrar, BootstrapResolver, RankRegistration, check_read_access

UNSENDABLE = ["s3crét", "tok\x01en", "tok\x7fen"]


@pytest.mark.parametrize("token", UNSENDABLE)
def test_the_registry_refuses_a_token_no_client_can_send(token: str) -> None:
    with pytest.raises(ValueError, match="token"):
        BootstrapConfig(token=token)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--token", token])
    assert exited.value.code == 2


@pytest.mark.parametrize("token", UNSENDABLE)
def test_clients_refuse_such_a_token_at_once(start_registry: Callable[..., RegistryProc], token: str) -> None:
    reg = start_registry("--token", "s3cret")
    registration = RankRegistration(rank_ip="127.0.0.1", rank_port=41000, page_size=16, kv_cache_dtype="auto")

    with pytest.raises(ValueError, match="token"):  # (made, not started: not after retrying until its timeout)
        BootstrapRegistrar(reg.url, registration, token=token, start_timeout_s=3.0)
    with pytest.raises(ValueError, match="token"):
        BootstrapResolver(token=token, registries=[reg.url])
    with pytest.raises(BootstrapError, match="token"):
        asyncio.run(check_read_access(reg.url, token))


def test_ordinary_tokens_still_work(start_registry: Callable[..., RegistryProc]) -> None:
    token = "Ab0-._~+/=xyz"  # (RFC 6750's b64token characters)
    assert BootstrapConfig(token=token).token == token
    reg = start_registry("--token", token)
    asyncio.run(check_read_access(reg.url, token))
    resolver = BootstrapResolver(token=token, registries=[reg.url])
    resolver.close()
