"""Control-plane messages between a decode (client) and a prefill's control port (server).

Frames: 4-byte big-endian length, then one msgpack-encoded ``Message`` (a tagged union). Flow:
1. decode -> prefill ``Register`` once per connection; prefill answers ``RegisterAck`` (ok or a reason).
2. decode -> prefill ``RoomRequest`` per room (destination page ids + aux slot, and the generation the
   decode gave this page list: the prefill's writes carry ``(room, generation)`` as their fence).
3. prefill -> decode ``RoomStatus`` per room: ok only after every write of the room is DONE.
4. ``Abort`` either way; ``Ping``/``Pong`` either way (any frame counts as a heartbeat).
5. prefill -> decode ``Quiesced`` once a room that failed (or was aborted) after its page list arrived
   has no write in flight any more: from then on no byte of it can land in the decode's pages.
Workers with a key (``transfer.auth``): before ``Register`` the decode sends ``AuthHello``, the prefill
answers ``AuthChallenge`` (its proof of the key), the decode ``AuthProof`` (its own); without a key none of
the three is sent (a prefill of an earlier release, which knows none of them, closes on ``AuthHello``: the
decode says so). New fields go last with defaults; ``Register.version`` (and ``AuthHello.version``) is
checked by the prefill.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import msgspec

from transfer.errors import TransferError, TransferErrorKind

PROTOCOL_VERSION = 2  # 2: RoomRequest.generation, fenced writes. (The key's handshake, AuthHello/AuthChallenge/
# AuthProof, is sent only by workers with a key and changes nothing else: keyless peers of either release agree)
MAX_FRAME_BYTES = 64 * 1024 * 1024
_SCRATCH_BYTES = 64 * 1024  # most one recv takes (a page list of ~10k pages is ~50 KB)
_LEN = struct.Struct(">I")


class Register(msgspec.Struct, tag="register", array_like=True, frozen=True):
    version: int
    backend: str
    endpoint: bytes
    kv_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    page_size: int
    kv_dtype: str


class RegisterAck(msgspec.Struct, tag="register_ack", array_like=True, frozen=True):
    ok: bool
    reason: str = ""
    kind: str = ""


class RoomRequest(msgspec.Struct, tag="room", array_like=True, gc=False, frozen=True):
    room: int
    page_ids: list[int]
    aux_index: int
    generation: int = 0


class RoomStatus(msgspec.Struct, tag="status", array_like=True, gc=False, frozen=True):
    room: int
    ok: bool
    kind: str = ""
    reason: str = ""
    aux_len: int = 0


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False, frozen=True):
    room: int
    reason: str


class Quiesced(msgspec.Struct, tag="quiesced", array_like=True, gc=False, frozen=True):
    room: int


class Ping(msgspec.Struct, tag="ping", array_like=True, gc=False, frozen=True):
    seq: int


class Pong(msgspec.Struct, tag="pong", array_like=True, gc=False, frozen=True):
    seq: int


class AuthHello(msgspec.Struct, tag="auth_hello", array_like=True, frozen=True):
    """Decode -> prefill, first, from a decode with a key: its protocol version and a fresh nonce."""

    version: int
    nonce: bytes


class AuthChallenge(msgspec.Struct, tag="auth_challenge", array_like=True, frozen=True):
    """Prefill -> decode: the prefill's nonce and its proof of the key over both nonces."""

    nonce: bytes
    proof: bytes


class AuthProof(msgspec.Struct, tag="auth_proof", array_like=True, frozen=True):
    """Decode -> prefill: the decode's proof of the key over both nonces (then its ``Register``)."""

    proof: bytes


Message = (Register | RegisterAck | RoomRequest | RoomStatus | Abort | Quiesced | Ping | Pong
           | AuthHello | AuthChallenge | AuthProof)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_frame(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:  # (RecursionError: nested too deeply)
        raise TransferError(TransferErrorKind.PROTOCOL, f"undecodable control message: {exc}") from exc


class FrameReader:
    """Reads frames from a blocking socket that may have a timeout set (timeouts are retried while
    ``keep_going()`` holds). Buffered: one ``recv`` takes whatever has arrived, so a frame usually costs one
    wait and one read, and frames that arrived together none more (the reader owns the socket's input: bytes
    past the frame it returns stay in its buffer for the next ``read``)."""

    def __init__(self, sock: socket.socket, keep_going: Callable[[], bool] | None = None) -> None:
        self._sock = sock
        self._keep_going = keep_going
        self._buf = bytearray()  # received, not yet returned: ``_buf[_pos:]``
        self._pos = 0
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._scratch_view = memoryview(self._scratch)

    def _fill(self) -> bool:
        """Append what the socket has (waiting for at least one byte); False at the end of the stream."""
        while True:
            try:
                n = self._sock.recv_into(self._scratch_view)
            except TimeoutError:
                if self._keep_going is not None and not self._keep_going():
                    raise
                continue
            if not n:
                return False
            if self._pos:  # (what was returned already goes: the buffer grows only with what is unread)
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += self._scratch_view[:n]
            return True

    def read(self) -> Message | None:
        """The next message, or None on a clean end of stream. Raises TransferError(PROTOCOL) for an
        oversized or undecodable frame, OSError for a broken connection."""
        while len(self._buf) - self._pos < _LEN.size:
            if not self._fill():
                if len(self._buf) == self._pos:
                    return None
                raise ConnectionResetError("control connection closed mid-frame")
        (length,) = _LEN.unpack_from(self._buf, self._pos)
        if length > MAX_FRAME_BYTES:
            raise TransferError(TransferErrorKind.PROTOCOL, f"control frame of {length} bytes is too large")
        start = self._pos + _LEN.size
        end = start + length
        while len(self._buf) < end:  # (it grows with what arrives, never to a length only claimed)
            if not self._fill():
                raise ConnectionResetError("control connection closed mid-frame")
            start, end = self._pos + _LEN.size, self._pos + _LEN.size + length  # (``_fill`` may have compacted)
        body = bytes(self._buf[start:end])
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        else:
            self._pos = end
        return decode_body(body)
