"""The per-room aux record the prefill writes into the decode's aux slot with its last KV chunk."""

from __future__ import annotations

import struct

import msgspec

from workers.protocol import TokenLogprob

_LEN = struct.Struct("<I")


class AuxRecord(msgspec.Struct, array_like=True):
    first_token: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AuxRecord)


def encode_aux(record: AuxRecord, slot_bytes: int) -> bytes:
    body = _encoder.encode(record)
    if _LEN.size + len(body) > slot_bytes:
        raise ValueError(f"aux record of {len(body)} bytes does not fit a {slot_bytes}-byte slot")
    return _LEN.pack(len(body)) + body


def decode_aux(slot: bytes | memoryview) -> AuxRecord:
    """Decode a slot; raises ValueError when it holds no valid record (KV never arrived)."""
    (length,) = _LEN.unpack_from(slot)
    if length == 0 or _LEN.size + length > len(slot):
        raise ValueError("aux slot holds no record")
    try:
        return _decoder.decode(bytes(slot[_LEN.size : _LEN.size + length]))
    except msgspec.DecodeError as exc:
        raise ValueError(f"aux slot holds a corrupt record: {exc}") from exc
