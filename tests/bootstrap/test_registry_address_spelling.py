"""Review: a prefill and its decode spelling one registry differently (``localhost`` / ``127.0.0.1``)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from conftest import RegistryProc, rank_body

from bootstrap.client import BootstrapResolver


def test_the_token_goes_to_the_own_registry_however_the_prefill_spells_it(
    start_registry: Callable[..., RegistryProc],
) -> None:
    """Prefill ``--bootstrap http://localhost:P`` (announced as ``localhost``), decode ``--bootstrap
    http://127.0.0.1:P``: one registry, the one the decode trusts, yet its look-ups go without the token and a
    ``--token-scope all`` registry (the standalone default) answers 401 to every room."""
    reg = start_registry("--ttl-s", "0", "--token", "s3cret", "--token-scope", "all")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="c", rank_port=52000), timeout=5,
              headers={"authorization": "Bearer s3cret"})
    resolver = BootstrapResolver(cache_ttl_s=0, token="s3cret", registries=[f"http://127.0.0.1:{reg.port}"])
    try:
        assert resolver.resolve("localhost", reg.port, "c") == ("127.0.0.1", 52000)
    finally:
        resolver.close()
