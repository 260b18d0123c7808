"""The relay's HTTP client over ``https://``: a worker's certificate is verified (a self-signed one is refused unless
the pool is given a context that trusts it), and a verified connection is kept alive like a plain one.

The certificate is made at test time with the ``openssl`` command (skipped where it is missing)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
import uvloop

from gateway.worker_http import ConnectFailed, HttpPool

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def _serve(cert: Path, key: Path, connections: list[int]) -> tuple[asyncio.Server, int]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(ANSWER)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_workers_certificate_is_verified_and_its_connection_kept_alive(certificate: tuple[Path, Path],
                                                                        loop_kind: str) -> None:
    cert, key = certificate

    async def main() -> None:
        connections: list[int] = []
        server, port = await _serve(cert, key, connections)
        strict = HttpPool(limit_per_host=2, timeout_s=10.0, connect_timeout_s=5.0)  # (the system's CAs: not its signer)
        trusting = HttpPool(limit_per_host=2, timeout_s=10.0, connect_timeout_s=5.0,
                            ssl_context=ssl.create_default_context(cafile=str(cert)))
        try:
            with pytest.raises(ConnectFailed, match=r"(?i)certificate"):
                await strict.post(f"https://localhost:{port}/generate", b"{}")
            assert strict._by_key and all(o.num_open == 0 for o in strict._by_key.values())
            for _ in range(2):
                async with await trusting.post(f"https://localhost:{port}/generate", b"{}") as reply:
                    assert reply.status == 200 and await reply.read() == b"{}"
            assert trusting.num_idle() == 1
            assert len(connections) == 1, "the verified connection was not kept alive"
        finally:
            strict.close()
            trusting.close()
            server.close()
            await server.wait_closed()

    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(main(), 30))
