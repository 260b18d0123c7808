"""What logit_bias, the penalties and min_tokens cost per decode step, next to the sampling they add to.

``LogitAdjuster.adjust`` (``workers/engines/llama/penalties.py``) on random float32 logits of SmolLM2's
vocabulary (49,152) at batch 1, 16 and 64, every sequence with a repetition, presence and frequency
penalty, 8 logit_bias entries and min_tokens, in steady decode (records built, one new token a step),
histories of ``--history`` tokens. Prints µs per step (median of ``--steps``) of:

- ``adjust``: the four adjustments over the batch (what a penalised batch adds);
- ``first``: one step in which every sequence's record is built from its whole history (a decode's first
  step after the hand-off, or a sequence's first sample), slots already allocated;
- baseline, same run: the engine's own per-step sampling work without them, ``argmax`` over the batch plus
  one ``log_softmax`` row per sequence (what ``sample`` and the logprobs cost); and the same argmax alone.

    .venv/bin/python loadtests/bench_penalties.py [--steps 300] [--batches 1,16,64] [--history 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from workers.engines.base import SeqInput  # noqa: E402
from workers.engines.llama.penalties import LogitAdjuster  # noqa: E402
from workers.protocol import SamplingParams  # noqa: E402

VOCAB = 49_152
EOS = (2,)


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def run(batch: int, steps: int, history: int) -> dict[str, float]:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                            logit_bias={rng.randrange(VOCAB): 5.0 for _ in range(8)}, min_new_tokens=10**6,
                            max_new_tokens=10**6)
    histories = [[rng.randrange(VOCAB) for _ in range(history)] for _ in range(batch)]
    prompt_len = history // 2
    logits = torch.randn(batch, VOCAB)

    def seqs(with_history: bool) -> list[SeqInput]:
        return [SeqInput(i, [], len(h) - 1, h[-1:], True, params, len(h) - prompt_len, h if with_history else None)
                for i, h in enumerate(histories)]

    first: list[float] = []
    adjuster = LogitAdjuster(VOCAB, EOS)
    adjuster.adjust(logits, seqs(True))  # slots allocated once, as in a running engine
    for _ in range(5):
        for i in range(batch):
            adjuster.forget(i)
        t0 = time.perf_counter()
        adjuster.adjust(logits, seqs(True))
        first.append(time.perf_counter() - t0)
    adjust: list[float] = []
    for _ in range(steps):
        for h in histories:
            h.append(rng.randrange(VOCAB))
        batch_seqs = seqs(False)  # steady state: the engine extends its records by the fed token
        t0 = time.perf_counter()
        adjuster.adjust(logits, batch_seqs)
        adjust.append(time.perf_counter() - t0)
    base: list[float] = []
    argmax: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits.argmax(dim=-1).tolist()
        t1 = time.perf_counter()
        for j in range(batch):
            torch.log_softmax(logits[j], dim=-1)
        base.append(time.perf_counter() - t0)
        argmax.append(t1 - t0)
    return {"batch": batch, "adjust_us": _median_us(adjust), "first_us": _median_us(first),
            "baseline_us": _median_us(base), "argmax_us": _median_us(argmax)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--history", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"vocab {VOCAB}, history {args.history} tokens, median of {args.steps} steps, 1 thread")
    print(f"{'batch':>5} {'adjust µs':>10} {'first µs':>10} {'baseline µs':>12} {'argmax µs':>10} "
          f"{'adjust/baseline':>16}")
    for batch in (int(b) for b in args.batches.split(",")):
        r = run(batch, args.steps, args.history)
        print(f"{batch:>5} {r['adjust_us']:>10.0f} {r['first_us']:>10.0f} {r['baseline_us']:>12.0f} "
              f"{r['argmax_us']:>10.0f} {r['adjust_us'] / r['baseline_us']:>15.2f}x")


if __name__ == "__main__":
    main()
