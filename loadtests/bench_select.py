"""Micro-benchmark: ``select()`` cost per policy at 8, 64 and 512 workers per role (µs per call).

Views are the gateway's real ``WorkerState`` objects fed with load reports; the prefix index is the
real ``PrefixIndex`` holding every worker's share of 64 tenants' prompts. Each call gets a fresh
``RequestInfo`` (a 1,024-token prompt of one of those tenants), so the cache-aware rows include
hashing the prompt's pages and the index look-up, as in the gateway. ``random`` is the baseline
measured in the same run.

    .venv/bin/python loadtests/bench_select.py [--calls 2000] [--policies random,power_of_two,...]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.policies import RequestInfo
from gateway.prefix_index import PrefixIndex
from gateway.router import Router
from gateway.worker_state import WorkerState
from workers.page_cache import page_hashes
from workers.protocol import HelloAck, KVEvents, LoadReport

PAGE_SIZE = 16
PROMPT_TOKENS = 1024


def make_pool(rng: random.Random, n: int, role: str) -> list[WorkerState]:
    pool = []
    for i in range(n):
        state = WorkerState(f"pd://{role}-{i}:9000", role)
        state.connected(HelloAck(2, f"{role}-{i}", role, "sim", "m", "byte", PAGE_SIZE, 8192, 4096))
        state.reported(LoadReport(num_running=rng.randrange(64), num_waiting=rng.randrange(8),
                                  num_free_pages=rng.randrange(4096), num_total_pages=4096,
                                  num_prefill_tokens=rng.randrange(50_000), prefill_tokens_per_s=20_000.0,
                                  max_running=64, busy_fraction=rng.random()))
        pool.append(state)
    return pool


def bench(policy: str, n: int, calls: int) -> float:
    rng = random.Random(n)
    prefills, decodes = make_pool(rng, n, "prefill"), make_pool(rng, n, "decode")
    router = Router.build(policy, policy, {"": {"seed": "1"}} if policy in ("random", "power_of_two") else None)
    index: PrefixIndex = router.index
    tenants = [[rng.randrange(50_000) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    for t, prompt in enumerate(tenants):
        for w in rng.sample(prefills, min(2, n)):
            index.apply(w.url, KVEvents(stored=page_hashes(prompt[: 512 + 8 * t], PAGE_SIZE)))
    requests = [rng.choice(tenants) for _ in range(calls)]
    started = time.perf_counter()
    for prompt in requests:
        router.select(prefills, decodes, RequestInfo(prompt, 128, index))
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--policies", default="random,round_robin,power_of_two,cache_aware,ratio_aware")
    args = ap.parse_args()
    sizes = (8, 64, 512)
    print(f"\nselect() µs per call, {PROMPT_TOKENS}-token prompts, page size {PAGE_SIZE}, "
          "N prefill + N decode workers\n")
    print(f"{'policy':14}" + "".join(f"{f'N={n}':>12}" for n in sizes))
    for policy in args.policies.split(","):
        print(f"{policy:14}" + "".join(f"{bench(policy, n, args.calls):12.1f}" for n in sizes), flush=True)
    # What hashing alone costs (done once per request, shared by retries).
    prompt = list(range(PROMPT_TOKENS))
    started = time.perf_counter()
    for _ in range(args.calls):
        page_hashes(prompt, PAGE_SIZE)
    print(f"\n(of which page hashing of a {PROMPT_TOKENS}-token prompt: "
          f"{(time.perf_counter() - started) / args.calls * 1e6:.1f} µs)")


if __name__ == "__main__":
    main()
