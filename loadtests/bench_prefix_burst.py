"""A burst of requests sharing one prompt prefix on one worker: in-flight prefix sharing on and off.

A prefix-aware router sends requests with the same system prompt to the same prefill worker, so they
often arrive there together, before any of them has computed (and cached) the prefix. With
``SchedulerConfig.wait_for_prefix`` (the default) the later ones wait for the first one's pages and
compute only their own suffix; without it every request of the burst computes the whole prefix.

In-process: one ``Scheduler`` (role ``both``, prefix cache on, the worker's default chunk size and page
size) over a real engine, the torch engine on the embedded SmolLM2-135M-Instruct by default (one
thread). Per round and mode, a fresh scheduler (empty cache) gets ``--requests`` prompts of a
shared random prefix of ``--prefix`` tokens plus a distinct suffix of ``--suffix`` tokens, all in the
same step, ``max_new_tokens=1``, and is stepped until every request ends. Printed per mode (medians
over ``--rounds`` rounds, the modes alternating): the prompt tokens the engine computed, the time
until the last request's first token, and the mean and worst time to first token. The baseline is the
mode without waiting, measured in the same run.

    .venv/bin/python loadtests/bench_prefix_burst.py [--requests 8] [--prefix 512] [--suffix 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.config import WorkerConfig
from workers.engines.base import Engine, EngineOptions
from workers.kv_pool import KVPool
from workers.protocol import Outputs, SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig

MODES = {"wait for the prefix": True, "no waiting (baseline)": False}


def make_engine(name: str) -> Engine:
    if name == "sim":  # the sim engine, charging per prefill token like a compute-bound prefill
        from workers.engines.sim import SimEngine

        return SimEngine(EngineOptions(extra={"prefill_token_s": "0.0002", "decode_step_s": "0", "verify_kv": "0"}))
    from workers.engines.llama import TorchEngine
    from workers.engines.llama.gguf_convert import default_model_dir

    return TorchEngine(EngineOptions(model=default_model_dir(), num_threads=1))


def one_burst(engine: Engine, prompts: list[list[int]], wait: bool) -> tuple[int, float, list[float]]:
    """(prompt tokens computed, seconds until the last first token, each request's time to first token)."""
    defaults = WorkerConfig()
    info = engine.info
    page_size = defaults.page_size
    need = sum(-(-(len(p) + 2) // page_size) for p in prompts)
    pool = KVPool(num_layers=info.num_layers, num_pages=need, page_size=page_size, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim, dtype=info.kv_dtype)
    engine.bind(pool)
    first: dict[int, float] = {}
    started = time.perf_counter()

    def sink(messages: list[tuple[int, object]]) -> None:
        now = time.perf_counter()
        for _, msg in messages:
            if isinstance(msg, Outputs):
                for item in msg.items:
                    if item.token_ids:
                        first.setdefault(item.rid, now - started)

    config = SchedulerConfig("both", chunk_size=defaults.chunk_size, max_running=defaults.max_running,
                             wait_for_prefix=wait)
    sched = Scheduler(config, engine, pool, sink)
    for rid, prompt in enumerate(prompts):
        sched.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))
    while sched.reqs or not first:
        sched.step()
    stats = sched.stats()
    computed = stats["num_prompt_tokens"] - stats["num_cached_prompt_tokens"]
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(first)} requests ended without a token")
    return computed, max(first.values()), [first[rid] for rid in range(len(prompts))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_prefix_burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("torch", "sim"), default="torch")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix", type=int, default=512, help="shared prompt tokens")
    p.add_argument("--suffix", type=int, default=32, help="each request's own prompt tokens after the prefix")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    engine = make_engine(args.engine)
    rng = random.Random(0)
    vocab = engine.info.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(args.suffix)] for _ in range(args.requests)]
    one_burst(engine, prompts[:1], True)  # warm-up: the engine's first forward pays its one-time costs
    rows: dict[str, list[tuple[int, float, float, float]]] = {mode: [] for mode in MODES}
    print(f"{args.engine} engine: {args.requests} requests of {args.prefix} shared + {args.suffix} own prompt "
          f"tokens, submitted together; {args.rounds} rounds")
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else list(MODES)[::-1]:
            computed, last, ttfts = one_burst(engine, prompts, MODES[mode])
            rows[mode].append((computed, last, statistics.fmean(ttfts), max(ttfts)))
    print(f"{'mode':>24} {'tokens computed':>16} {'last first token s':>19} {'TTFT mean / max s':>19}")
    for mode, runs in rows.items():
        med = [statistics.median(r[i] for r in runs) for i in range(4)]
        print(f"{mode:>24} {med[0]:>16,.0f} {med[1]:>19.3f} {med[2]:>10.3f} / {med[3]:.3f}")


if __name__ == "__main__":
    main()
