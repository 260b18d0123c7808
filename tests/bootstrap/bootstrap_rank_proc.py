"""A stand-in prefill rank for the tests: registers with BootstrapRegistrar, then heartbeats forever.

Usage: bootstrap_rank_proc.py URL INSTANCE_ID RANK_PORT TP_SIZE TP_RANK INTERVAL_S PAGE_SIZE
Prints ``REGISTERED`` once the first PUT succeeded; exits (closing the registrar) on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from bootstrap import BootstrapRegistrar, RankRegistration


async def main(argv: list[str]) -> None:
    url, instance_id, rank_port, tp_size, tp_rank, interval_s, page_size = argv
    registration = RankRegistration(
        rank_ip="127.0.0.1",
        rank_port=int(rank_port),
        page_size=int(page_size),
        kv_cache_dtype="auto",
        instance_id=None if instance_id == "default" else instance_id,
        attn_tp_size=int(tp_size),
        attn_tp_rank=int(tp_rank),
    )
    registrar = BootstrapRegistrar(url, registration, interval_s=float(interval_s), start_timeout_s=15)
    await registrar.start()
    print("REGISTERED", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await registrar.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
