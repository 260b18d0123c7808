"""A trivially fast worker speaking the native protocol: it isolates the gateway's own cost.

No engine, no KV, no scheduler thread: the worker answers as fast as one event loop can, so what a
benchmark measures through the gateway is the gateway (and the client), not a model or a step loop.
It announces itself like a ``sim`` worker (``tokenizer="byte"``, model ``sim``), so the gateway
loads the same tokenizer and serves the same model name.

Behaviour by role:
- ``prefill``: a ``Submit`` is answered at once with its one final ``StepOutput``
  (``finish_reason="transferred"``, no tokens). Its ``HelloAck`` names a bootstrap address (which
  nothing dials: there is no KV to move) because the gateway requires one of a prefill.
- ``decode`` / ``both``: ``max_new_tokens`` printable byte tokens (output position n is letter n % 26;
  a migrated stream's positions start at its ``output_offset``). With ``--token-gap-ms 0`` they all
  go in one ``StepOutput`` as soon as the ``Submit`` is read. With a gap, the first token goes at
  once and then every running request gets one more token per tick (every ``gap`` ms, on a fixed
  schedule), all of a connection's tokens of that tick in ONE ``Outputs`` frame, like a real
  decode step; the last one carries ``finish_reason="length"``.
- Whatever one read of a connection asks for is answered in one write (one ``Outputs`` frame).
- ``Abort`` drops the request; ``Ping`` gets a ``Pong`` (``num_steps`` = ticks so far). No
  ``LoadReport`` is sent: the gateway then routes on its own counts (the figures stay the gateway's).

Lifecycle: ``main`` binds the port (``--port 0``: any free port; the bound one is printed as
``fast_worker ready <role> 127.0.0.1:<port>``), serves until SIGTERM/SIGINT, then closes every
connection and exits 0.

    .venv/bin/python loadtests/fast_worker.py --role decode --port 9101 [--token-gap-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
import uuid
from pathlib import Path

import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    FramedProtocol,
    Hello,
    HelloAck,
    Outputs,
    Ping,
    Pong,
    Rejected,
    StepOutput,
    Submit,
    ToWorker,
    worker_codec,
)

TOKENS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]  # printable: one byte token = one character


class _Running:
    """One decode request between its first and its last token."""

    __slots__ = ("conn", "num_left", "num_sent", "prompt_tokens", "rid")

    def __init__(self, conn: _Conn, rid: int, num_left: int, prompt_tokens: int, num_sent: int = 1) -> None:
        self.conn = conn
        self.rid = rid
        self.num_left = num_left
        self.num_sent = num_sent  # the output position of its next token (a migrated stream's continues)
        self.prompt_tokens = prompt_tokens


class FastWorker:
    """Shared state of one worker process: the handshake it gives, the ticker, the running requests."""

    def __init__(self, role: str, token_gap_ms: float, *, model: str = "sim", max_context: int = 8192,
                 page_size: int = 16, num_pages: int = 1 << 20, host: str = "127.0.0.1", port: int = 0) -> None:
        self.role = role
        self.gap_s = token_gap_ms / 1000.0
        self.host, self.port = host, port
        self.codec = worker_codec()  # encodes; decoding reads memoryviews of the read buffer:
        self.decoder: msgspec.msgpack.Decoder[ToWorker] = msgspec.msgpack.Decoder(ToWorker)
        self.running: dict[tuple[int, int], _Running] = {}  # (connection id, rid) -> request
        self.num_ticks = 0
        self._next_tick = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._conn_ids = 0
        self.conns: set[_Conn] = set()
        self.hello_ack = HelloAck(
            version=PROTOCOL_VERSION, worker_id=f"fast-{role}-{uuid.uuid4().hex[:8]}", role=role, engine="fast",
            model=model, tokenizer="byte", page_size=page_size, max_context=max_context, num_pages=num_pages,
            bootstrap_host=host if role == "prefill" else None, bootstrap_port=8998 if role == "prefill" else None,
            instance_id=f"{host}:{port}" if role == "prefill" else None, transfer="none" if role != "both" else "",
        )

    def new_conn_id(self) -> int:
        self._conn_ids += 1
        return self._conn_ids

    def answer(self, conn: _Conn, msg: Submit, out: list[StepOutput]) -> None:
        """Outputs for a new request that go in this read's reply; later tokens wait for ticks."""
        num_prompt = len(msg.input_ids)
        if self.role == "prefill":
            out.append(StepOutput(msg.rid, [], "transferred", num_prompt))
            return
        num_tokens = max(1, msg.params.max_new_tokens)
        start = msg.params.output_offset  # a migrated stream's outputs so far: its letters go on from there
        if self.gap_s <= 0 or num_tokens == 1:
            out.append(StepOutput(msg.rid, token_ids(start, num_tokens), "length", num_prompt))
            return
        out.append(StepOutput(msg.rid, token_ids(start, 1), None, num_prompt))
        self.running[(conn.conn_id, msg.rid)] = _Running(conn, msg.rid, num_tokens - 1, num_prompt, start + 1)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._next_tick = loop.time() + self.gap_s
            self._timer = loop.call_at(self._next_tick, self._tick)

    def _tick(self) -> None:
        """One decode step: a token for every running request, one frame per connection."""
        self._timer = None
        self.num_ticks += 1
        batches: dict[_Conn, list[StepOutput]] = {}
        done: list[tuple[int, int]] = []
        for key, req in self.running.items():
            req.num_left -= 1
            finish = "length" if req.num_left == 0 else None
            item = StepOutput(req.rid, token_ids(req.num_sent, 1), finish)
            req.num_sent += 1
            batch = batches.get(req.conn)
            if batch is None:
                batches[req.conn] = [item]
            else:
                batch.append(item)
            if finish is not None:
                done.append(key)
        for key in done:
            del self.running[key]
        for conn, items in batches.items():
            conn.send(Outputs(items))
        if self.running:
            loop = asyncio.get_running_loop()
            # A fixed schedule (no drift); a late tick does not try to catch up with a burst.
            self._next_tick = max(self._next_tick + self.gap_s, loop.time())
            self._timer = loop.call_at(self._next_tick, self._tick)

    def drop(self, conn: _Conn, rid: int | None = None) -> None:
        if rid is not None:
            self.running.pop((conn.conn_id, rid), None)
            return
        for key in [k for k in self.running if k[0] == conn.conn_id]:
            del self.running[key]


def token_ids(start: int, count: int) -> list[int]:
    return [TOKENS[i % len(TOKENS)] for i in range(start, start + count)]


class _Conn(FramedProtocol):
    """One gateway connection: frames parsed in ``data_received``, one write per read."""

    def __init__(self, worker: FastWorker) -> None:
        super().__init__()
        self.worker = worker
        self.conn_id = worker.new_conn_id()
        self.transport: asyncio.Transport | None = None
        self._greeted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self.worker.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker.conns.discard(self)
        self.worker.drop(self)

    def send(self, message: msgspec.Struct) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.worker.codec.encode(message))

    def _frames(self, buf: bytes | bytearray) -> int:
        """Handle every whole frame in ``buf``; returns the bytes used. All replies go in one write."""
        worker, codec = self.worker, self.worker.codec
        pos, end = 0, len(buf)
        out: list[StepOutput] = []
        replies: list[bytes] = []
        with memoryview(buf) as view:
            while end - pos >= 4:
                size = int.from_bytes(view[pos:pos + 4], "big")
                if size > MAX_FRAME_BYTES:
                    self._fail(f"frame of {size} bytes")
                    return end
                if end - pos - 4 < size:
                    break
                try:
                    message = worker.decoder.decode(view[pos + 4:pos + 4 + size])
                except msgspec.DecodeError as exc:
                    self._fail(f"bad frame: {exc}")
                    return end
                pos += 4 + size
                match message:
                    case Submit() as msg if self._greeted:
                        worker.answer(self, msg, out)
                    case Abort(rid=rid) if self._greeted:
                        worker.drop(self, rid)
                    case Ping(nonce=nonce):
                        replies.append(codec.encode(Pong(nonce, worker.num_ticks, 0.0)))
                    case Hello(version=version) if not self._greeted:
                        if version != PROTOCOL_VERSION:
                            self.send(Rejected(f"protocol version {PROTOCOL_VERSION} required, got {version}"))
                            self._fail("bad protocol version")
                            return end
                        self._greeted = True
                        replies.append(codec.encode(worker.hello_ack))
                    case other:
                        self._fail(f"unexpected {type(other).__name__}")
                        return end
        if out:
            replies.append(codec.encode(Outputs(out)))
        if replies and self.transport is not None and not self.transport.is_closing():
            self.transport.write(replies[0] if len(replies) == 1 else b"".join(replies))
        return pos

    def _fail(self, reason: str) -> None:
        print(f"fast_worker: closing connection {self.conn_id}: {reason}", file=sys.stderr, flush=True)
        if self.transport is not None:
            self.transport.close()


async def serve(worker: FastWorker) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(worker), worker.host, worker.port)
    worker.port = int(server.sockets[0].getsockname()[1])
    if worker.role == "prefill":
        worker.hello_ack.instance_id = f"{worker.host}:{worker.port}"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gc.collect()
    gc.freeze()
    print(f"fast_worker ready {worker.role} {worker.host}:{worker.port}", flush=True)
    await stop.wait()
    server.close()
    for conn in list(worker.conns):
        if conn.transport is not None:
            conn.transport.close()
    await server.wait_closed()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fast_worker", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="native protocol port (0: any free port, printed)")
    p.add_argument("--token-gap-ms", type=float, default=0.0,
                   help="decode: one token per running request every this many ms (0: all tokens at once)")
    p.add_argument("--model", default="sim", help="model name in the handshake")
    p.add_argument("--max-context", type=int, default=8192)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.token_gap_ms < 0:
        sys.exit("fast_worker: --token-gap-ms must be >= 0")
    worker = FastWorker(args.role, args.token_gap_ms, model=args.model, max_context=args.max_context,
                        host=args.host, port=args.port)
    uvloop.run(serve(worker))


if __name__ == "__main__":
    main()
