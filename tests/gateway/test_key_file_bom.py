"""Review (area A, 2026-12-06): a key file saved with a UTF-8 byte-order mark (Windows PowerShell 5's
``Set-Content -Encoding UTF8``/``Out-File``, older Notepad) kept the mark in its first key. ``read_keys`` strips
white space, which U+FEFF is not: the gateway then waited for a key no client sends and refused every request
with the right one 401, with nothing said at start; the worker's ``--api-key-file`` failed on a "control
character" its file does not visibly hold. Fails before the fix (``encoding="utf-8-sig"``)."""

from __future__ import annotations

from pathlib import Path

from gateway.keys import one_key, read_keys
from gateway.middleware import GatekeeperMiddleware


def test_a_key_file_with_a_byte_order_mark_gives_the_keys_it_shows(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n# spare\nk2\n", encoding="utf-8-sig")
    assert read_keys(str(keys)) == ["k1", "k2"]
    one = tmp_path / "worker-key"
    one.write_text("wk\n", encoding="utf-8-sig")
    assert one_key(None, str(one), "PD_TEST_UNSET_KEY", "worker_api_key") == "wk"

    gate = GatekeeperMiddleware(None, api_keys=read_keys(str(keys)), admin_api_keys=[],  # type: ignore[arg-type]
                                metrics_require_admin=False, is_draining=lambda: False)
    assert gate.refusal("/v1/completions", [(b"authorization", b"Bearer k1")]) is None
    refused = gate.refusal("/v1/completions", [(b"authorization", b"Bearer nope")])
    assert refused is not None and refused[0] == 401


def test_a_key_file_without_a_mark_reads_as_before(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_bytes("  k\u00e9y \r\n\r\n#x\r\nk2".encode())
    assert read_keys(str(keys)) == ["k\u00e9y", "k2"]
