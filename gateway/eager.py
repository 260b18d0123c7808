"""Run a coroutine's first step now, inside the caller's callback, and hand the rest to a task.

Python 3.11 has no eager tasks (3.12's ``eager_start``): a task made in a protocol callback takes its
first step only when the loop next runs its ready queue, behind whatever the same pass has queued
(a decode frame's chunk writes, streams' last steps), and what that step queues in turn (a
``Submit`` to a worker) waits one more pass. ``start`` runs the first step at once, in its own
context, like a task would; when the coroutine suspends, a task created then continues it from
where it waits. Used by the gateway's HTTP protocol (``gateway.http_protocol``) to dispatch a
generation request from the callback in which its body arrived.

Inside the first step there is no task of its own yet: ``asyncio.current_task()`` is ``None`` in a
protocol callback (the caller's task, if ``start`` is called from one) and ``asyncio.timeout`` cannot be
used; the coroutine must not need either before it first suspends.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any

_HANDED = object()  # ``_Continuation._first`` once the task has been given the first step's future


def start(coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop,
          context: contextvars.Context | None = None) -> asyncio.Task[Any] | None:
    """Run ``coro`` up to its first suspension now (in ``context``, a fresh copy of the current one by
    default); then a task (returned) continues it in the same context. ``None``: it finished at once.
    An exception it raises in that first step propagates here."""
    context = contextvars.copy_context() if context is None else context
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_Continuation(coro, waiting_on), context=context)


class _Continuation(Coroutine[Any, Any, Any]):
    """The coroutine from its first suspension on, for a task: the task's first step is handed the
    future the coroutine already waits on; every later step (a value or an exception, cancellation
    included, even before that first step) goes to the coroutine itself."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self._coro = coro
        self._first = waiting_on

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _HANDED:
            self._first = _HANDED
            return first  # (the task waits on it as if the coroutine had just yielded it)
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._first = _HANDED
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # (the deprecated three-argument form, as given)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("a continuation is run by its task, not awaited")
