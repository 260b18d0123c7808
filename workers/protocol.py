"""The native gateway <-> worker protocol: msgspec frames over one persistent stream connection.

Lifecycle of a connection:
1. The gateway connects (TCP, or a Unix socket when co-located) and sends ``Hello`` with its
   protocol version; the worker answers ``HelloAck`` (its role, model, tokenizer, KV shape and
   where its bootstrap registration lives) or ``Rejected`` and closes.
2. The gateway sends ``Submit`` / ``Abort`` at any time, multiplexed by ``rid`` (unique per
   connection). The worker answers with ``Outputs`` frames batched per engine step (new tokens,
   and ``finish_reason`` on the last item of a request) or one ``Error`` ending that request.
3. The worker sends each connection a ``LoadReport`` when its load changed (a finish at most every
   ``REPORT_MIN_INTERVAL_S``, an admission within ``MOVED_REPORT_S``: see ``workers.scheduler``), at least
   every 100 ms while it holds requests and every 0.5 s when idle. ``last_rid`` is the newest rid of that
   connection the worker had admitted when it measured, so the gateway knows exactly which of its own
   dispatches the figures already include.
4. ``Ping`` at any time: the worker's event loop answers ``Pong`` with the scheduler's progress
   (a frozen process answers nothing; a stuck scheduler shows a growing ``stalled_s``).
5. ``GetTokenizer`` (only to a worker whose ``HelloAck.tokenizer_files`` is >= 1): the worker answers
   ``TokenizerFiles`` with the files of its tokenizer directory, so a gateway on another host needs no
   copy of the model (``gateway/remote_tokenizer.py`` asks on a connection of its own).
6. Workers with a prefix cache broadcast ``KVEvents`` once per step in which pages were published
   (``stored``) or evicted (``removed``), as the chained page hashes of ``workers.page_cache``. A new
   connection first gets a snapshot (``reset=True``: every hash the worker holds now).

A frame is a 4-byte big-endian length followed by one msgpack-encoded message. Unknown kinds are a
protocol error. Backpressure: neither side blocks on a slow reader; each bounds what it has written and
the peer has not read (``MAX_UNREAD_BYTES``, on top of the kernel's socket buffers) and past it drops
the connection, which ends that connection's requests on both sides (pages freed, the gateway's
retries and stream migration take over). New fields go last with defaults; bump ``PROTOCOL_VERSION`` on breaking change.
"""

from __future__ import annotations

import asyncio
import struct
from enum import StrEnum

import msgspec

PROTOCOL_VERSION = 4  # 2: KVEvents, LoadReport fields for routing; 3: SamplingParams.logit_bias, penalties,
# min_new_tokens, grammar (a version-2 worker would silently drop them), Error.param, GetTokenizer;
# 4: SamplingParams.prompt_logprobs_start (a version-3 worker would send the whole prompt's, read as a tail)
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_HELLO_BYTES = 64 * 1024  # a peer's first frame (its ``Hello``, a few bytes) before it is known to speak
MAX_UNREAD_BYTES = 64 * 1024 * 1024  # written, still unread by the peer: past it the peer is not reading
# A connection whose peer host answers nothing this long (it died, or the network was cut) is closed by the kernel
# (``transfer.netaddr.watch_peer``): its requests end rather than hold their places until their own timeouts
PEER_TIMEOUT_S = 30.0
_LEN = FRAME_HEADER = struct.Struct(">I")  # a frame's length prefix
_pack_len = _LEN.pack


class Grammar(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on a request's output; hashable, so compiled grammars are cached by it.

    ``kind``: "json_object" (any JSON object; ``source`` unused), "json_schema" (``source`` a JSON
    Schema document), "regex" or "ebnf" (GBNF, as SGLang takes it). ``strict``: unsupported JSON
    Schema keywords are an error (False: ignored). ``param``: the client's name for the field, for
    error messages (e.g. ``response_format.json_schema.schema``).
    """

    kind: str
    source: str = ""
    strict: bool = True
    param: str = "grammar"


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request generation settings; the same struct is used by the gateway and every engine."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    # Stop strings: a worker that advertises ``HelloAck.stop_strings`` ends the request ("stop") at the
    # token whose text completes one; the gateway still trims the text. Others ignore the field.
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # The first prompt position whose logprob is wanted (SGLang's ``logprob_start_len``, resolved by the
    # gateway): positions before it are neither computed nor sent, and may come from the prefix cache.
    prompt_logprobs_start: int = 0
    # Outputs generated before this request (a migrated stream): seeded draws continue at their true
    # output position (``workers/engines/llama/sampling.py``).
    output_offset: int = 0
    # Logit adjustments from the request's own history (``workers/engines/llama/penalties.py``); an
    # engine that does not implement one refuses a request that sets it (``Engine.supported_sampling``).
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # SGLang/HF: positive logits of prompt + output tokens divided, negative multiplied
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs (incl. output_offset)
    # Constrained decoding (``workers/grammar.py``): every sampled token, on the prefill and the decode,
    # keeps the output a prefix of the grammar's language; None = unconstrained.
    grammar: Grammar | None = None


class Hello(msgspec.Struct, tag="hello"):
    version: int
    client: str = "gateway"
    key: str = ""  # the worker's --api-key, when it was started with one (the gateway's --worker-api-key)


class HelloAck(msgspec.Struct, tag="hello_ack"):
    version: int
    worker_id: str
    role: str  # "prefill" | "decode" | "both"
    engine: str
    model: str
    tokenizer: str  # "byte" or a directory holding tokenizer.json
    page_size: int
    max_context: int
    num_pages: int
    # Where decode workers find this prefill worker's KV control endpoint.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    instance_id: str | None = None
    transfer: str = ""
    # Version of the tokenizer-files exchange this worker serves (``GetTokenizer`` -> ``TokenizerFiles``);
    # 0: none (an older worker). A gateway without a local copy of ``tokenizer`` asks for the files.
    tokenizer_files: int = 0
    # Whether this worker ends a request at its stop strings (``SamplingParams.stop``) as it decodes,
    # and the ``gateway.tokenizer.tokenizer_digest`` of the tokenizer whose text it watches ("": unknown).
    stop_strings: bool = False
    tokenizer_digest: str = ""


TOKENIZER_FILES_VERSION = 1
# What a worker serves of its tokenizer directory (everything ``gateway.hf_tokenizer`` reads).
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                        "config.json", "special_tokens_map.json")


class GetTokenizer(msgspec.Struct, tag="get_tokenizer"):
    """Gateway -> worker, only to a worker whose ``HelloAck.tokenizer_files`` >= 1: send your tokenizer."""

    version: int = TOKENIZER_FILES_VERSION


class TokenizerFiles(msgspec.Struct, tag="tokenizer_files"):
    """Worker -> gateway: the files of its tokenizer directory (names from ``TOKENIZER_FILE_NAMES``), or
    none with ``tokenizer == "byte"``; ``error`` when they could not be read."""

    tokenizer: str
    files: dict[str, bytes] = {}
    error: str = ""


class Rejected(msgspec.Struct, tag="rejected"):
    reason: str


class BootstrapTarget(msgspec.Struct, array_like=True):
    """Where the decode side finds the prefill's KV control endpoint for one room."""

    host: str
    port: int | None
    room: int
    instance_id: str | None = None


class Submit(msgspec.Struct, tag="submit", omit_defaults=True):
    rid: int
    input_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapTarget | None = None
    timeout_s: float = 600.0
    request_id: str = ""  # the client's x-request-id, for the worker's logs
    # Decode: after the first token, this request's outputs may be held and sent as one once this
    # long has passed since the first one held (a whole response: its client needs no token sooner;
    # fewer, larger outputs cost both sides less). 0: every step's output at once.
    gather_s: float = 0.0


class Abort(msgspec.Struct, tag="abort"):
    rid: int
    reason: str = "aborted by client"


class Ping(msgspec.Struct, tag="ping"):
    """Health probe; the worker's event loop answers at once (a frozen process does not)."""

    nonce: int


class Pong(msgspec.Struct, tag="pong"):
    nonce: int
    num_steps: int = 0  # scheduler steps run so far
    stalled_s: float = 0.0  # seconds since the scheduler last finished a step while holding requests


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float


class StepOutput(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """New tokens of one request in one engine step (finish_reason set on its last step)."""

    rid: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "transferred"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[float] | None = None
    kv_verified: bool | None = None  # sim engine: the imported KV matched the prompt
    # With ``prompt_logprobs`` and ``SamplingParams.top_logprobs``: each prompt position's most likely
    # tokens ([] where unknown, e.g. the first). Last: an older peer reads the fields before it.
    prompt_top_logprobs: list[list[TokenLogprob]] | None = None


def joined(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (``a`` is not final)."""
    logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
    top = a.top_logprobs + b.top_logprobs if a.top_logprobs is not None and b.top_logprobs is not None else None
    return StepOutput(
        a.rid, a.token_ids + b.token_ids, b.finish_reason, b.prompt_tokens or a.prompt_tokens,
        max(a.cached_tokens, b.cached_tokens), logprobs, top,
        b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs,
        b.kv_verified if b.kv_verified is not None else a.kv_verified,
        b.prompt_top_logprobs if b.prompt_top_logprobs is not None else a.prompt_top_logprobs,
    )


class Outputs(msgspec.Struct, tag="out", gc=False):
    items: list[StepOutput]


class Fault(StrEnum):
    """Whose failure an ``Error`` reports (what the gateway's circuit breakers hold it against)."""

    OWN = "own"  # the sending worker's own
    PEER = "peer"  # its KV-transfer peer's: the peer went away, fell silent or could not be reached
    NONE = "none"  # neither worker's: the bootstrap registry failed, or the peer aborted (it reports its own)


class Error(msgspec.Struct, tag="error"):
    rid: int
    code: str  # "bad_request" | "transfer_failed" | "timeout" | "aborted" | "overloaded" | "internal"
    message: str
    fault: str = Fault.OWN  # a ``Fault`` (a plain str on the wire: an unknown value from a newer worker decodes)
    param: str | None = None  # bad_request: the client's field at fault (e.g. "response_format"), when known


class LoadReport(msgspec.Struct, tag="load", omit_defaults=True):
    """A worker's load as it measured it at the end of a scheduler step (units in the names)."""

    num_running: int  # sequences in a batch (prefilling or decoding)
    num_waiting: int  # sequences admitted but not yet in a batch (bootstrap, prealloc, waiting)
    num_free_pages: int  # KV pages an allocation could take now (free + evictable cached)
    num_total_pages: int
    num_inflight_transfers: int = 0
    num_prefill_tokens: int = 0  # prompt tokens still to compute: queued (less their cached prefix) + running
    last_rid: int = 0  # newest rid of the receiving connection admitted before this report
    prefill_tokens_per_s: float = 0.0  # measured prefill throughput (EWMA; 0 = not measured yet)
    max_running: int = 0  # the worker's batch limit (sequences)
    num_transfer_seqs: int = 0  # decode: sequences holding pages while their KV arrives
    num_queued_pages: int = 0  # decode: pages the admitted-but-not-yet-allocated requests will take
    busy_fraction: float = 0.0  # share of recent wall time spent in engine steps (EWMA, ~1 s)


class KVEvents(msgspec.Struct, tag="kv", gc=False, omit_defaults=True):
    """Prefix-cache changes of one scheduler step: chained page hashes published and evicted.

    Net effect per hash within the step (a hash is in at most one list). ``reset`` says: forget what
    you knew of this worker's cache, ``stored`` is all of it (sent to a new connection).
    """

    stored: list[bytes] = []
    removed: list[bytes] = []
    reset: bool = False


ToWorker = Hello | Submit | Abort | Ping | GetTokenizer
ToGateway = HelloAck | Rejected | Outputs | Error | LoadReport | KVEvents | Pong | TokenizerFiles


class FrameCodec:
    """Reusable msgpack encoder/decoder for one direction of the protocol."""

    def __init__(self, incoming: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        # A message's body, without its length prefix (``encode``: ``FRAME_HEADER.pack(len(body)) + body``), for a
        # caller that frames it inline (the gateway's per-request ``Submit``)
        self.encode_body = self._encoder.encode
        self._decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct) -> bytes:
        body = self.encode_body(message)
        return _pack_len(len(body)) + body

    def decode(self, body: bytes) -> object:
        return self._decoder.decode(body)


def gateway_codec() -> FrameCodec:
    return FrameCodec(ToGateway)


def worker_codec() -> FrameCodec:
    return FrameCodec(ToWorker)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame body of at most ``max_bytes``; raises ``asyncio.IncompleteReadError`` on EOF."""
    header = await reader.readexactly(_LEN.size)
    (length,) = _LEN.unpack(header)
    if length > max_bytes:
        raise ValueError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return await reader.readexactly(length)


class FramedProtocol(asyncio.Protocol):
    """Frames parsed in ``data_received``, no reader coroutine: subclasses handle every whole frame of a
    read in ``_frames(buf) -> bytes used``; a partial frame waits in a buffer for the next read."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def data_received(self, data: bytes) -> None:
        if self._buf:
            self._buf += data
            used = self._frames(self._buf)
            del self._buf[:used]
        else:  # the common case: nothing left over, parse straight from ``data``
            used = self._frames(data)
            if used < len(data):
                self._buf += memoryview(data)[used:]

    def _frames(self, buf: bytes | bytearray) -> int:
        raise NotImplementedError
