"""Blocking-socket helpers and hypothesis strategies for the frame fuzz tests (4-byte big-endian length +
msgpack body: the native protocol of workers/protocol.py and the KV control plane of transfer/messages.py)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from hypothesis import strategies as st

LEN = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def encode(msg: Any) -> bytes:
    """A frame holding ``msg`` (a Struct, or any msgpack-able value)."""
    return frame(_encoder.encode(msg))


def whole_frames(data: bytes, max_bytes: int) -> Iterator[bytes | None]:
    """The bodies of the whole length-prefixed frames at the start of ``data``, in order; None for a
    length past ``max_bytes`` (a reader ends the connection there). A trailing partial frame is left
    out: it may yet complete."""
    pos = 0
    while len(data) - pos >= 4:
        size = int.from_bytes(data[pos:pos + 4], "big")
        if size > max_bytes:
            yield None
            return
        if len(data) - pos - 4 < size:
            return
        yield data[pos + 4:pos + 4 + size]
        pos += 4 + size


def connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def send_all(sock: socket.socket, data: bytes) -> bool:
    """False if the peer has closed already (it may, before taking everything)."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(sock: socket.socket) -> bytes | None:
    """The next frame body, or None on end of stream."""
    head = read_exact(sock, LEN.size)
    if head is None:
        return None
    return read_exact(sock, LEN.unpack(head)[0])


def closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the peer ends the connection within ``timeout_s`` (what it sends meanwhile is dropped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset: ended too
            return True
    return False


# -- strategies ----------------------------------------------------------------------------------
INT64 = st.integers(-(2**63), 2**63 - 1)
MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
GARBAGE = st.binary(max_size=96)
# msgpack arrays nested this deep (one inside the other), as raw bytes: deeper than any decoder recurses
DEEP = st.integers(100, 20000).map(lambda depth: b"\x91" * depth + b"\x90")


def deep_map(kind: str) -> st.SearchStrategy[bytes]:
    """A msgpack map tagged ``kind`` with one unknown field nested ``DEEP``."""
    head = b"\x82" + b"".join(_encoder.encode(v) for v in ("type", kind, "x"))
    return DEEP.map(lambda deep: head + deep)


def deep_array(kind: str, *fields: Any) -> st.SearchStrategy[bytes]:
    """A msgpack array tagged ``kind`` (``array_like``), ``fields``, then one more element nested ``DEEP``."""
    head = bytes([0x90 + 2 + len(fields)]) + b"".join(_encoder.encode(v) for v in (kind, *fields))
    return DEEP.map(lambda deep: head + deep)


def oversized_header(limit: int) -> st.SearchStrategy[bytes]:
    return st.integers(limit + 1, 2**32 - 1).map(LEN.pack)


def tagged_maps(kinds: list[str], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Maps tagged like a message of ``kinds`` (``"type"``), with known field names holding anything."""
    return st.builds(lambda kind, known, extra: {**extra, **known, "type": kind}, st.sampled_from(kinds),
                     st.dictionaries(st.sampled_from(fields), MSGPACK_VALUES, max_size=len(fields)),
                     st.dictionaries(st.text(max_size=6), MSGPACK_VALUES, max_size=2))


def tagged_arrays(kinds: list[str]) -> st.SearchStrategy[list[Any]]:
    """Arrays tagged like an ``array_like`` message of ``kinds`` (tag first), then anything."""
    return st.builds(lambda kind, rest: [kind, *rest], st.sampled_from(kinds), st.lists(MSGPACK_VALUES, max_size=12))
