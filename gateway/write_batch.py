"""Client writes made while one worker frame is dispatched, written together when it ends.

A decode frame carries one output for each of many streams, and the direct path
(``gateway.responder``) writes each stream's chunk from that frame's callback. Written one at a time,
between the Python work of the next stream's chunk, each write may find its reader asleep and wake it
again (a loopback send wakes the reader inside the sender's system call). Gathered and written back to
back when the frame ends, the readers are woken about once per burst; the price is that a frame's
first chunks wait until its last one is built (tens of µs for a frame of 32 streams).

Lifecycle (one thread's event loop): ``WorkerClient`` calls ``begin`` before it hands a frame's outputs
out and ``end`` after (in ``finally``); ``write`` in between gathers, outside writes at once. Writes of
one transport keep their order; a transport closed by then is skipped.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class _Batch(threading.local):
    pending: list[tuple[Any, bytes]] | None = None  # the open batch of this thread's loop


local = _Batch()  # (``pending``: read in place by a caller that gathers once per streamed token)


def begin() -> bool:
    """Start gathering; False when a batch is already open (then the caller must not ``end`` it)."""
    if local.pending is not None:
        return False
    local.pending = []
    return True


def end() -> None:
    """Write what was gathered, in order, and stop gathering. A transport that refuses a write (one
    half-closed meanwhile) loses its own; the others are written all the same, and nothing raises
    into the worker connection's callback that ends the batch."""
    pending = local.pending
    local.pending = None
    if not pending:
        return
    writes = iter(pending)
    while True:  # (the ``try`` around the loop, not in it: per write, fewer opcodes; a failed write resumes it)
        try:
            for transport, data in writes:
                if not transport.is_closing():
                    transport.write(data)
            return
        except (RuntimeError, OSError) as exc:  # (uvloop: "Cannot call write() after write_eof()")
            log.warning("a client write failed (%s); closing that connection", exc)
            transport.close()


def write(transport: Any, data: bytes) -> None:
    """``transport.write(data)`` now, or when the open batch ends."""
    pending = local.pending
    if pending is None:
        transport.write(data)
    else:
        pending.append((transport, data))
