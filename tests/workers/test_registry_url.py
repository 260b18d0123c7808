"""``--bootstrap`` is read once into one spelling (``bootstrap.client.registry_url``): the registrar, the
address a prefill advertises in its handshake and a decode's look-ups all mean the same registry (a bare
``host:port`` registered at it while the handshake named port 8998: every request failed)."""

from __future__ import annotations

import pytest

from bootstrap.client import registry_url
from workers.config import ConfigError, WorkerConfig


@pytest.mark.parametrize("given, want", [
    ("127.0.0.1:18331", "http://127.0.0.1:18331"),
    ("localhost", "http://localhost:8998"),  # (a bare host: SGLang's port)
    ("http://10.0.0.1", "http://10.0.0.1:80"),  # (a URL: its scheme's)
    ("https://registry.example/pd/", "https://registry.example:443/pd"),
    ("http://[::1]:9000", "http://[::1]:9000"),
    (" http://127.0.0.1:8998/ ", "http://127.0.0.1:8998"),
])
def test_one_spelling(given: str, want: str) -> None:
    assert registry_url(given) == want
    assert WorkerConfig(role="prefill", bootstrap=given).bootstrap == want


@pytest.mark.parametrize("bad", ["ftp://host:1", "http://host:99999", "http://:8998", "http://h:1/?x=1", "http://h:0"])
def test_not_a_registry_url_is_a_config_error_naming_the_flag(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^bootstrap: "):
        WorkerConfig(role="decode", bootstrap=bad)
