"""The worker's tokenizer for a gateway that has no copy of the model (another host, no shared filesystem).

Lifecycle:
1. ``needs_fetch(spec, ack)``: the worker named a tokenizer directory (``HelloAck.tokenizer``) that is not
   on this machine, and it serves its files (``HelloAck.tokenizer_files`` >= 1).
2. ``await fetch_tokenizer(host, port)`` opens a connection of its own to the worker's native port
   (``Hello`` -> ``HelloAck``, then ``GetTokenizer`` -> ``TokenizerFiles``, skipping the load reports a
   worker sends every connection), closes it, and writes the files into a directory named by their
   SHA-256 under ``$PD_GATEWAY_CACHE`` (default ``~/.cache/pd-gateway``)``/tokenizers/`` (written to a
   temporary directory first and renamed, so a half-written copy is never used). It answers the
   directory, which ``gateway.tokenizer.load_tokenizer`` then loads like any other.
``RemoteTokenizerError`` says which worker failed and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile

from workers.protocol import (
    PROTOCOL_VERSION,
    TOKENIZER_FILE_NAMES,
    GetTokenizer,
    Hello,
    HelloAck,
    Rejected,
    TokenizerFiles,
    gateway_codec,
    read_frame,
)


class RemoteTokenizerError(RuntimeError):
    """The worker's tokenizer could not be fetched; the message names the worker."""


def needs_fetch(spec: str, ack: HelloAck) -> bool:
    return spec != "byte" and not os.path.isfile(os.path.join(spec, "tokenizer.json")) and ack.tokenizer_files >= 1


def cache_root() -> str:
    return os.environ.get("PD_GATEWAY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pd-gateway")


async def fetch_tokenizer(host: str, port: int, timeout_s: float = 60.0, key: str | None = None) -> str:
    where = f"worker {host}:{port}"
    try:
        async with asyncio.timeout(timeout_s):
            answer = await _ask(host, port, key)
    except TimeoutError:  # (first: on Python 3.11 it is an OSError too)
        raise RemoteTokenizerError(f"fetching the tokenizer from {where}: no answer within {timeout_s:g}s") from None
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        raise RemoteTokenizerError(f"fetching the tokenizer from {where}: {type(exc).__name__}: {exc}") from exc
    if answer.error:
        raise RemoteTokenizerError(f"{where} could not send its tokenizer: {answer.error}")
    bad = [name for name in answer.files if name not in TOKENIZER_FILE_NAMES]
    if bad or "tokenizer.json" not in answer.files:
        raise RemoteTokenizerError(f"{where} sent unexpected tokenizer files {sorted(answer.files)}")
    try:
        return await asyncio.to_thread(_store, answer.files)
    except OSError as exc:  # the cache is not writable (a file in its place, no space, no permission)
        raise RemoteTokenizerError(f"storing the tokenizer from {where} under {cache_root()}: {exc}") from exc


async def _ask(host: str, port: int, key: str | None = None) -> TokenizerFiles:
    codec = gateway_codec()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(codec.encode(Hello(PROTOCOL_VERSION, client="gateway-tokenizer", key=key or "")))
        ack = codec.decode(await read_frame(reader))
        if isinstance(ack, Rejected):
            raise ValueError(f"handshake rejected: {ack.reason}")
        if not isinstance(ack, HelloAck) or ack.tokenizer_files < 1:
            raise ValueError("the worker does not serve its tokenizer files")
        writer.write(codec.encode(GetTokenizer()))
        while True:
            message = codec.decode(await read_frame(reader))
            if isinstance(message, TokenizerFiles):
                return message
            # load reports and KV events arrive on every connection: not ours to handle
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _store(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    root = os.path.join(cache_root(), "tokenizers")
    final = os.path.join(root, digest.hexdigest()[:32])
    if os.path.isfile(os.path.join(final, "tokenizer.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=root)
    try:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        try:
            os.rename(tmp, final)
        except OSError:  # another gateway stored the same files meanwhile
            if not os.path.isfile(os.path.join(final, "tokenizer.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
