"""The per-room aux record the prefill writes into the decode's aux slot with its last KV chunk."""

from __future__ import annotations

import array
import hashlib
import struct

import msgspec

from workers.protocol import TokenLogprob

_LEN = struct.Struct("<I")


class AuxRecord(msgspec.Struct, array_like=True):
    first_token: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    # ``prompt_digest`` of the prompt whose KV this is: the decode checks it is its own request's (a room given
    # to two requests, as a client choosing rooms through the SGLang API can, must not answer one with the
    # other's KV); None from a prefill that does not send it
    prompt: bytes | None = None


def prompt_digest(input_ids: list[int]) -> bytes:
    """8 bytes that tell two prompts apart (BLAKE2b of the token ids)."""
    return hashlib.blake2b(array.array("I", input_ids).tobytes(), digest_size=8).digest()


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
