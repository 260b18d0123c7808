"""``gateway.remote_tokenizer`` against a stand-in worker (a real asyncio server speaking the frames):
the files land in a content-addressed cache, worker-side errors and unexpected files are clear errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.remote_tokenizer import RemoteTokenizerError, fetch_tokenizer
from workers.protocol import (
    PROTOCOL_VERSION,
    GetTokenizer,
    Hello,
    HelloAck,
    LoadReport,
    TokenizerFiles,
    read_frame,
    worker_codec,
)


def _ack(tokenizer_files: int = 1) -> HelloAck:
    return HelloAck(PROTOCOL_VERSION, "w", "both", "torch", "m", "/models/m", 16, 64, 8,
                    tokenizer_files=tokenizer_files)


async def _serve(answer: Callable[[], TokenizerFiles], ack: HelloAck) -> tuple[asyncio.Server, int, list[object]]:
    codec = worker_codec()
    seen: list[object] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(codec.decode(await read_frame(reader)))
            writer.write(codec.encode(ack))
            writer.write(codec.encode(LoadReport(0, 0, 8, 8)))  # what every connection gets: to be skipped
            seen.append(codec.decode(await read_frame(reader)))
            writer.write(codec.encode(answer()))
            await writer.drain()
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _fetch(answer: Callable[[], TokenizerFiles], ack: HelloAck | None = None) -> tuple[str, list[object]]:
    async def run() -> tuple[str, list[object]]:
        server, port, seen = await _serve(answer, ack or _ack())
        try:
            return await fetch_tokenizer("127.0.0.1", port, timeout_s=10), seen
        finally:
            server.close()

    return asyncio.run(run())


FILES = {"tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b'{"chat_template": "x"}'}


def test_files_are_stored_once_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))
    path, seen = _fetch(lambda: TokenizerFiles("/models/m", FILES))
    assert isinstance(seen[0], Hello) and isinstance(seen[1], GetTokenizer)
    assert Path(path).parent == tmp_path / "tokenizers"
    assert {p.name: p.read_bytes() for p in Path(path).iterdir()} == FILES
    again, _ = _fetch(lambda: TokenizerFiles("/models/m", FILES))
    assert again == path and len(list((tmp_path / "tokenizers").iterdir())) == 1  # no partial copies left
    other, _ = _fetch(lambda: TokenizerFiles("/models/m", {**FILES, "tokenizer.json": b"{}"}))
    assert other != path


@pytest.mark.parametrize(("answer", "needle"), [
    (TokenizerFiles("/models/m", error="/models/m has no tokenizer.json"), "could not send its tokenizer"),
    (TokenizerFiles("/models/m", {"tokenizer_config.json": b"{}"}), "unexpected tokenizer files"),
    (TokenizerFiles("/models/m", {**FILES, "../../etc/passwd": b"x"}), "unexpected tokenizer files"),
])
def test_worker_errors_and_odd_files_are_refused(answer: TokenizerFiles, needle: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))
    with pytest.raises(RemoteTokenizerError, match=needle) as info:
        _fetch(lambda: answer)
    assert "127.0.0.1:" in str(info.value)
    assert not (tmp_path / "tokenizers").exists() or not any((tmp_path / "tokenizers").iterdir())


def test_an_unwritable_cache_is_a_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an OSError escaping into the gateway's start (or its background fetch task)."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(blocker))
    with pytest.raises(RemoteTokenizerError, match=r"storing the tokenizer from worker 127\.0\.0\.1:"):
        _fetch(lambda: TokenizerFiles("/models/m", FILES))


def test_a_worker_that_does_not_serve_files_is_not_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))
    with pytest.raises(RemoteTokenizerError, match="does not serve its tokenizer files"):
        _fetch(lambda: TokenizerFiles("/models/m", FILES), ack=_ack(tokenizer_files=0))


def test_an_unreachable_worker_is_named() -> None:
    from gateway.cluster import free_port

    port = free_port()
    with pytest.raises(RemoteTokenizerError, match=f"worker 127.0.0.1:{port}"):
        asyncio.run(fetch_tokenizer("127.0.0.1", port, timeout_s=5))


def test_a_fetch_under_way_ends_with_the_gateway() -> None:
    """``Gateway.aclose`` cancels the background tokenizer fetch (no task left pending past shutdown)."""
    from gateway.runtime import Gateway, GatewayConfig

    async def main() -> None:
        gw = Gateway(GatewayConfig(worker=("pd://127.0.0.1:9",)))
        fetch = asyncio.get_running_loop().create_task(asyncio.sleep(100))  # stands for a slow worker's answer
        gw._tokenizer_fetch = fetch
        await gw.aclose()
        assert fetch.cancelled()

    asyncio.run(main())
