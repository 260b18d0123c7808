"""SIGTERM and SIGHUP stop a load test as Ctrl-C does, so that it stops the servers it started.

The benchmarks start their servers each in a session of its own (a terminal's Ctrl-C reaches only the
benchmark, which stops and reaps them in ``finally``). Python's default for SIGTERM and SIGHUP ends the
process without running any ``finally``: ``timeout``, a cancelled CI job or a closed terminal left every
server running under init. After ``stop_like_ctrl_c()`` both signals do what SIGINT does at that moment:
inside ``asyncio.run`` / ``uvloop.run`` the main task is cancelled, elsewhere ``KeyboardInterrupt`` is
raised (also where SIGINT is ignored, as in a non-interactive shell's background job).

    from stop_signals import stop_like_ctrl_c   # (soak.py: from loadtests.stop_signals import ...)
    stop_like_ctrl_c()                          # first thing in main()
"""

from __future__ import annotations

import signal
from types import FrameType


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIG_IGN or SIG_DFL: still stop, through the callers' ``finally``
        raise KeyboardInterrupt


def stop_like_ctrl_c() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _as_sigint)
