"""Security review: key configuration that must not fail open, keys kept out of reprs, and text logs that a
client cannot forge lines into."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.context import configure_logging
from gateway.runtime import GatewayConfig

WORKERS = ["--prefill", "pd://127.0.0.1:1", "--decode", "pd://127.0.0.1:2"]


@pytest.mark.parametrize("flags", [("--api-key-file",), ("--api-key", "client", "--admin-api-key-file")])
def test_a_key_file_without_a_key_is_refused_not_read_as_no_keys(flags: tuple[str, ...], tmp_path: Path) -> None:
    """An operator who gives a key file means to set keys: a file left empty (or all comments, keys rotated out)
    must stop the gateway, not start it open (``--api-key-file``: every route, the admin API included, with no
    key; ``--admin-api-key-file``: the admin API silently guarded by the client keys instead)."""
    empty = tmp_path / "keys"
    empty.write_text("# rotated out\n\n")
    with pytest.raises(ValueError, match="key"):
        config_from_args(build_parser().parse_args([*WORKERS, *flags, str(empty)]))


def test_the_config_repr_shows_no_key() -> None:
    """``worker_api_key`` is ``repr=False``; the client and admin keys are not, so any log or traceback of the
    config would carry them."""
    config = GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",),
                           api_keys=("client-secret",), admin_api_keys=("admin-secret",))
    assert "client-secret" not in repr(config) and "admin-secret" not in repr(config), repr(config)


def test_a_text_log_line_is_one_line_whatever_the_client_sent() -> None:
    """The responder logs a refused request's error message, which echoes client input (a content part's type, a
    json_schema's type, a regex): in the text format a newline starts a forged log line and ESC drives the
    operator's terminal. (The JSON format escapes both.)"""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging("info", "text")
        stream = io.StringIO()
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        client_text = "EVIL\n2026-01-01 00:00:00,000 CRITICAL gateway.fake [-]: INJECTED \x1b[31mRED\x1b[0m"
        logging.getLogger("gateway.responder").info("%s -> %d %s: %s", "chat", 400, "invalid_request_error",
                                                    f"{client_text} content parts are not supported")
        out = stream.getvalue()
        assert out.count("\n") == 1 and "\x1b" not in out, repr(out)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def test_a_cluster_reachable_from_elsewhere_gets_keys_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pd-cluster --host 0.0.0.0``: its workers and registry take keys, random unless the environment gives
    them (the children inherit them from the environment, never on a command line)."""
    from gateway.cluster import _cluster_secrets

    monkeypatch.setenv("PD_WORKER_API_KEY", "")  # (unset, as an empty one reads; restored after the test)
    monkeypatch.setenv("PD_BOOTSTRAP_TOKEN", "given")
    _cluster_secrets()
    import os

    key = os.environ["PD_WORKER_API_KEY"]
    assert len(key) >= 24 and os.environ["PD_BOOTSTRAP_TOKEN"] == "given"
    _cluster_secrets()
    assert os.environ["PD_WORKER_API_KEY"] == key


@pytest.mark.parametrize("key", ["", "with space", "tab\tkey"])
def test_a_worker_key_that_cannot_be_sent_is_refused(key: str) -> None:
    from workers.config import ConfigError, WorkerConfig

    with pytest.raises(ConfigError, match="api_key"):
        WorkerConfig(api_key=key)
    assert "s3cret" not in repr(WorkerConfig(api_key="s3cret", bootstrap_token="s3cret"))


@pytest.mark.parametrize(("host", "api_keys", "admin_keys", "off"), [
    ("0.0.0.0", (), (), True), ("::", (), (), True), ("10.1.2.3", (), (), True),
    ("0.0.0.0", ("k",), (), False), ("0.0.0.0", (), ("a",), False),
    ("127.0.0.1", (), (), False), ("localhost", (), (), False), ("::1", (), (), False),
])
def test_the_admin_api_is_off_on_a_gateway_others_reach_with_no_key_for_it(
        host: str, api_keys: tuple[str, ...], admin_keys: tuple[str, ...], off: bool) -> None:
    """An open admin API on a gateway other hosts reach hands anyone the fleet: a worker of theirs added gets
    the clients' prompts and the workers' key (``--worker-api-key`` goes to every worker). ``pd-cluster --host
    0.0.0.0`` started exactly that. Off (403) unless a key guards it; served on loopback as before."""
    from gateway.app import create_app

    app = create_app(GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",), host=host,
                                   api_keys=api_keys, admin_api_keys=admin_keys))
    gate = app.app  # (RequestContextMiddleware -> GatekeeperMiddleware)
    for path in ("/workers", "/add_worker", "/remove_worker", "/list_workers"):
        refusal = gate.refusal(path, [])
        if off:
            assert refusal is not None and refusal[0] == 403 and b"admin_api_off" in refusal[1], path
        else:
            assert refusal is None or refusal[0] == 401, path
    assert gate.refusal("/health", []) is None


@pytest.mark.parametrize("key", [" client", "client\t", "cli\x00ent"])
def test_a_key_that_could_never_match_stops_the_gateway(key: str) -> None:
    """A request's key is read without the white space around it (and a header cannot carry control characters):
    a configured key with either could never match, and every request with it would be a 401 with no word why."""
    for field in ("api_keys", "admin_api_keys"):
        with pytest.raises(ValueError, match="white space"):
            GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",), **{field: (key,)})
    GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",), api_keys=("a key with spaces",))


@pytest.mark.parametrize("key", ["voilà", "są", "k\u00a0k"])
def test_a_utf8_key_is_read_whole_from_the_header(key: str) -> None:
    """A key's UTF-8 bytes may end in 0x85 or 0xa0 (à, …): the header's key is read without HTTP's white space
    (space, tab) only, or such a key, accepted at start, was a 401 on every request."""
    from gateway.middleware import bearer_key

    raw = key.encode()
    assert bearer_key([(b"authorization", b"Bearer " + raw + b" ")]) == raw
    assert bearer_key([(b"authorization", b"Bearer \t" + raw)]) == raw
