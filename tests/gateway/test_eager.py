"""``gateway.eager.start``: a coroutine's first step at once, the rest in a task, with a task's semantics."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
import uvloop

from gateway import eager

VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("VAR", default=None)


async def _body(future: asyncio.Future[Any], log: list[Any]) -> int:
    VAR.set("set in the first step")
    log.append("first step")
    try:
        value = await future
        log.append(("woken", value, VAR.get()))
        await asyncio.sleep(0)  # a bare yield: the task must step it again
        log.append(("after a bare yield", VAR.get()))
        return value * 2
    except asyncio.CancelledError:
        log.append("cancelled")
        await asyncio.sleep(0)  # cleanup that itself waits
        log.append("cleaned up")
        raise


def _run(main: Any) -> None:
    uvloop.run(main())


def test_first_step_runs_at_once_and_the_task_continues_in_its_context() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        log: list[Any] = []
        task = eager.start(_body(future, log), loop)
        assert log == ["first step"]  # before the loop ran anything
        assert task is not None and VAR.get() is None  # its context is its own
        future.set_result(21)
        assert await task == 42
        assert log[1:] == [("woken", 21, "set in the first step"), ("after a bare yield", "set in the first step")]

    _run(main)


def test_a_coroutine_that_finishes_in_its_first_step_needs_no_task() -> None:
    async def done_at_once() -> int:
        return 1

    async def main() -> None:
        assert eager.start(done_at_once(), asyncio.get_running_loop()) is None

    _run(main)


def test_an_exception_in_the_first_step_propagates_to_the_caller() -> None:
    async def fails() -> None:
        raise ValueError("bad")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad"):
            eager.start(fails(), asyncio.get_running_loop())

    _run(main)


@pytest.mark.parametrize("when", ["before the task's first step", "while it waits"])
def test_cancellation_reaches_the_coroutine(when: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        log: list[Any] = []
        task = eager.start(_body(future, log), loop)
        assert task is not None
        if when == "while it waits":
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["first step", "cancelled", "cleaned up"]

    _run(main)


def test_the_awaited_futures_exception_is_raised_where_it_awaits() -> None:
    async def catches(future: asyncio.Future[int]) -> str:
        try:
            await future
        except KeyError as exc:
            return f"caught {exc.args[0]}"
        return "not raised"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        task = eager.start(catches(future), loop)
        assert task is not None
        future.set_exception(KeyError("k"))
        assert await task == "caught k"

    _run(main)


@pytest.mark.parametrize(("body", "streams"), [
    (b'{"model": "m", "stream": true}', True),
    (b'{"stream":true,"messages":[]}', True),
    (b'{"stream" :\n true}', True),
    (b'{"model": "m", "stream": false}', False),
    (b'{"model": "m"}', False),
    (b'{"messages": [{"role": "user", "content": "say \\"stream\\": true"}]}', False),
])
def test_only_a_stream_starts_in_the_reads_callback(body: bytes, streams: bool) -> None:
    """``GuardedHttpProtocol`` starts a request eagerly when its body asks for a stream (the first token
    waits on it); a whole response starts as a task. Text that merely quotes the key does not count."""
    from gateway.http_protocol import _asks_to_stream

    assert _asks_to_stream(body) is streams
    assert _asks_to_stream(bytearray(body)) is streams
