"""The scheduler's own cost per decode step at batch 1, 8 and 64, in-process, next to the engine's.

One ``Scheduler`` (role ``both``, prefix cache on, as ``--role both`` runs it) over the sim engine
at zero model cost with ``verify_kv=0``: the engine's ``forward`` is then only its own bookkeeping
(one token per sequence from the previous token and position), so what a step costs beyond it is
the scheduler: the inbox, deadlines, the PD/batch lists, building ``SeqInput``s, accepting tokens,
``StepOutput``s, the flush to the sink (which discards), the page growth of a combined worker, load
reports. A decode worker's running batch goes through the same code (its PD queues are empty once
every sequence runs).

Per batch size it fills the batch (prompts of ``--prompt-tokens``, ``ignore_eos``), waits until
every sequence decodes, then times ``--steps`` steps on this thread's CPU clock and prints µs per
step (whole step, engine forward, scheduler = the difference), and the scheduler's µs per sequence
per step. Baseline in the same run: the engine's forward, timed inside the same steps.

    .venv/bin/python loadtests/bench_scheduler.py [--steps 2000] [--batches 1,8,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.engines.base import EngineOptions, SeqInput, SeqOutput  # noqa: E402
from workers.engines.sim import SimEngine  # noqa: E402
from workers.kv_pool import KVPool  # noqa: E402
from workers.protocol import SamplingParams, Submit  # noqa: E402
from workers.scheduler import Scheduler, SchedulerConfig  # noqa: E402

ZERO_COST = {"prefill_token_s": "0", "decode_step_s": "0", "decode_seq_s": "0", "verify_kv": "0"}


class TimedEngine(SimEngine):
    """The sim engine, with the CPU time spent in ``forward`` added up."""

    forward_ns = 0

    def forward(self, batch: list[SeqInput]) -> list[SeqOutput]:
        started = time.thread_time_ns()
        try:
            return super().forward(batch)
        finally:
            self.forward_ns += time.thread_time_ns() - started


def measure(batch_size: int, num_steps: int, prompt_tokens: int, page_size: int) -> dict[str, float]:
    engine = TimedEngine(EngineOptions(extra=dict(ZERO_COST)))
    info = engine.info
    max_new = num_steps + 256  # fill and warm-up steps too: nobody finishes while timed
    pages_each = -(-(prompt_tokens + max_new) // page_size)
    pool = KVPool(num_layers=info.num_layers, num_pages=batch_size * pages_each + 8, page_size=page_size,
                  num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, num_aux_slots=batch_size + 1)
    engine.bind(pool)
    config = SchedulerConfig("both", chunk_size=max(512, prompt_tokens * batch_size), max_running=batch_size)
    sched = Scheduler(config, engine, pool, lambda messages: None)
    sched._conns[0] = 0  # one gateway connection: load reports are built as in service
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for rid in range(1, batch_size + 1):
        prompt = [(rid * 7919 + i) % (info.vocab_size - 1) + 1 for i in range(prompt_tokens)]
        sched.submit(0, Submit(rid, prompt, params))
    for _ in range(1000):
        sched.step()
        if len(sched._running) == batch_size and not sched._prefilling:
            break
    else:
        raise RuntimeError(f"batch {batch_size}: sequences did not all start decoding")
    for _ in range(min(100, num_steps // 10)):  # warm up
        sched.step()
    engine.forward_ns = 0
    started = time.thread_time_ns()
    for _ in range(num_steps):
        sched.step()
    step_ns = (time.thread_time_ns() - started) / num_steps
    forward_ns = engine.forward_ns / num_steps
    assert len(sched._running) == batch_size, "a sequence finished during the timed steps"
    own_ns = step_ns - forward_ns
    return {"batch": batch_size, "steps": num_steps, "step_us": step_ns / 1e3, "engine_forward_us": forward_ns / 1e3,
            "scheduler_us": own_ns / 1e3, "scheduler_us_per_seq": own_ns / 1e3 / batch_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="one JSON object per batch size instead of the table")
    args = ap.parse_args()
    rows = [measure(int(b), args.steps, args.prompt_tokens, args.page_size) for b in args.batches.split(",")]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print("scheduler cost per decode step (role both, sim engine at zero cost, verify_kv=0; CPU time, this thread)")
    print(f"{'batch':>6} {'step µs':>9} {'engine µs':>10} {'scheduler µs':>13} {'sched µs/seq':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['step_us']:>9.1f} {r['engine_forward_us']:>10.1f} {r['scheduler_us']:>13.1f} "
              f"{r['scheduler_us_per_seq']:>13.2f}")


if __name__ == "__main__":
    main()
