"""A submit that reaches a worker while it stops is answered, and told shutting_down (in-process sim workers)."""

from __future__ import annotations

import asyncio
import time

from workers.config import WorkerConfig
from workers.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    HelloAck,
    Outputs,
    SamplingParams,
    Submit,
    gateway_codec,
    read_frame,
    worker_codec,
)
from workers.worker import Worker

_to_gw = gateway_codec()  # decodes what the worker sends
_enc = worker_codec()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_enc.encode(Hello(PROTOCOL_VERSION)))
    ack = _to_gw.decode(await read_frame(reader))
    assert isinstance(ack, HelloAck), ack
    return reader, writer


async def _next(reader: asyncio.StreamReader, kinds: tuple[type, ...], timeout_s: float = 5.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        msg = _to_gw.decode(await asyncio.wait_for(read_frame(reader), deadline - time.monotonic()))
        if isinstance(msg, kinds):
            return msg


def _submit(rid: int, max_new_tokens: int = 4) -> bytes:
    return _enc.encode(Submit(rid, [1, 2, 3, 4], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)))


def test_a_submit_reaching_a_stopping_worker_is_told_shutting_down_not_internal() -> None:
    """SIGTERM: ``Worker.aclose`` stops the scheduler, then closes the native server. A ``Submit`` that
    arrives in between (a gateway under load always has some on the wire) was answered ``internal``: the
    gateway neither retries it (a 502 for the client, before any byte) nor knows the worker is stopping,
    and holds it against the worker's breaker. A worker stopped on purpose says ``shutting_down``."""
    async def main() -> None:
        worker = Worker(WorkerConfig(role="both", engine="sim", num_pages=64, http_port=0))
        await worker.start()
        try:
            reader, writer = await _connect(worker.native_port)
            writer.write(_submit(1))
            out = await _next(reader, (Outputs, Error))
            assert isinstance(out, Outputs), out
            assert worker.scheduler is not None
            await asyncio.to_thread(worker.scheduler.stop)  # (what aclose does first)
            writer.write(_submit(2))  # (on the wire as the worker stops)
            err = await _next(reader, (Error,))
            while isinstance(err, Error) and err.rid == 1:  # (the open request: shutting_down, as it should)
                assert err.code == "shutting_down", err
                err = await _next(reader, (Error,))
            assert isinstance(err, Error) and err.rid == 2
            assert err.code == "shutting_down", f"a stopping worker answered {err.code!r}: {err.message}"
            writer.close()
        finally:
            await worker.aclose()

    asyncio.run(main())


def test_a_submit_queued_during_the_last_step_is_answered_when_the_worker_stops() -> None:
    """A ``Submit`` handed to the scheduler while it runs its last step (SIGTERM arrived meanwhile) was left
    in its inbox: never admitted, never answered. The gateway's request then hung until the connection
    closed (or, were the close stuck behind a step that takes long, until its own timeouts). Every submit
    the scheduler took gets an answer: ``shutting_down``."""
    async def main() -> None:
        worker = Worker(WorkerConfig(role="both", engine="sim", num_pages=64, http_port=0,
                                     engine_options={"decode_step_s": "0.4"}))
        await worker.start()
        try:
            reader, writer = await _connect(worker.native_port)
            writer.write(_submit(1, max_new_tokens=50))
            out = await _next(reader, (Outputs, Error))
            assert isinstance(out, Outputs), out  # (its next step, 0.4 s long, has begun)
            writer.write(_submit(2))
            await asyncio.sleep(0.1)  # (read and queued for the scheduler, mid-step)
            assert worker.scheduler is not None
            await asyncio.to_thread(worker.scheduler.stop)
            errors: dict[int, str] = {}
            while 2 not in errors:
                try:
                    err = await _next(reader, (Error,), timeout_s=2.0)
                except TimeoutError:
                    break
                assert isinstance(err, Error)
                errors[err.rid] = err.code
            assert errors.get(1) == "shutting_down", errors
            assert errors.get(2) == "shutting_down", f"request 2 was never answered: {errors}"
            writer.close()
        finally:
            await worker.aclose()

    asyncio.run(main())


def test_a_cache_flush_asked_of_a_stopped_scheduler_fails_at_once() -> None:
    """``flush_cache`` (the admin's ``/flush_cache``) on a worker whose scheduler has stopped: its future fails
    now, not after its caller's own timeout."""
    async def main() -> None:
        worker = Worker(WorkerConfig(role="both", engine="sim", num_pages=64, http_port=0))
        await worker.start()
        try:
            assert worker.scheduler is not None
            await asyncio.to_thread(worker.scheduler.stop)
            future = worker.scheduler.flush_cache()
            assert isinstance(future.exception(timeout=5), RuntimeError)
        finally:
            await worker.aclose()

    asyncio.run(main())
