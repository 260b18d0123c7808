"""``Dispatcher.decode_capacity`` is called by ``Frontend._params``, which runs on a prepare thread for a
long request body (``--prepare-thread-bytes``), and it refreshed the dispatcher's cached pool floors there
(``_set_floors``: the epoch stored first, the floors computed after). The event loop refreshing them at the
same time (a worker reconnected with another pool) could then be overwritten by the thread's older figures
under the newer epoch: stale floors kept until the next shape change, and requests sent to a decode whose
pool cannot hold them (``_fitting`` skipped)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from test_kv_capacity import _fleet, _picks, _resize

from gateway.worker_state import WorkerState


class _PausingList(list):  # type: ignore[type-arg]
    """The decodes list: iterated on the prepare thread, it pauses once after its last item was handed out."""

    def __init__(self, items: list[Any], thread_name: str) -> None:
        super().__init__(items)
        self.thread_name = thread_name
        self.paused = threading.Event()
        self.resume = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        items = list(super().__iter__())
        yield from items
        if threading.current_thread().name == self.thread_name and not self.paused.is_set():
            self.paused.set()
            assert self.resume.wait(10)


def test_a_prepare_thread_does_not_leave_stale_pool_floors() -> None:
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [64, 256])  # decode pools: 256 and 1024 tokens
        pausing = _PausingList(decodes, "prepare-thread")
        dispatcher.decodes = pausing
        WorkerState.shape_epoch += 1  # (a shape change the thread is the first to look at)
        thread = threading.Thread(target=dispatcher.decode_capacity, name="prepare-thread", daemon=True)
        thread.start()
        assert await asyncio.to_thread(pausing.paused.wait, 10)  # (the thread read the pools as they were)
        _resize(decodes[1], 32)  # decode 1 reconnects with a pool of 128 tokens; the loop looks at it at once
        assert dispatcher.decode_capacity() == 256
        pausing.resume.set()
        await asyncio.to_thread(thread.join, 10)
        assert dispatcher.decode_capacity() == 256, "the thread's older figures stayed"
        # 200 tokens: only decode 0 (256) holds it, decode 1 (128) does not
        assert {d for _, d in _picks(dispatcher, 100, 100)} == {decodes[0]}

    asyncio.run(main())
