"""Run a Python server with a switch that counts the bytecode it executes (``bench_work.py`` uses it).

    python loadtests/opcount.py OUT.json -m gateway.cli --port 8000 ...
    python loadtests/opcount.py OUT.json loadtests/floor_app.py --port 8100

The server runs as ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` would run it. ``SIGUSR1`` starts
counting, in the main thread (the event loop's): every opcode executed and every Python call, per code
object; ``SIGUSR2`` stops and writes ``OUT.json`` (a list of ``[opcodes, calls, "file:line(name)"]``).
Counting slows the server some fifty times, so it says how much Python a request runs, not how
long it takes; code in C (uvloop, httptools, msgspec, the kernel) is not counted at all.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import signal
import sys
from types import CodeType, FrameType
from typing import Any

_opcodes: collections.Counter[CodeType] = collections.Counter()
_calls: collections.Counter[CodeType] = collections.Counter()


def _local(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "opcode":
        _opcodes[frame.f_code] += 1
    return _local


def _global(frame: FrameType, event: str, arg: Any) -> Any:
    frame.f_trace_opcodes = True
    _calls[frame.f_code] += 1  # (a coroutine's or generator's every resumption is a "call" too)
    return _local


def _start(*_: Any) -> None:
    _opcodes.clear()
    _calls.clear()
    sys.settrace(_global)


def _stop(*_: Any) -> None:
    sys.settrace(None)
    rows = [[count, _calls[code], f"{os.path.relpath(code.co_filename)}:{code.co_firstlineno}({code.co_name})"]
            for code, count in _opcodes.items()]
    with open(_out + ".part", "w") as f:
        json.dump(rows, f)
    os.replace(_out + ".part", _out)  # (whoever waits for the file sees it whole)


def main() -> None:
    global _out
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    _out = sys.argv[1]
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


_out = ""

if __name__ == "__main__":
    main()
