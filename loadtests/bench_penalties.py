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

With ``--engine tiny|smollm2`` it also decodes with the torch engine, driven as the scheduler drives it
(``all_token_ids`` on every step of a penalised request), and prints decode tokens/s at each batch size
with the adjustments and, same run, without (greedy both; ``--decode-steps`` steps after a prefill of
``--prompt-len`` random tokens).

    .venv/bin/python loadtests/bench_penalties.py [--steps 300] [--batches 1,16,64] [--history 512]
    .venv/bin/python loadtests/bench_penalties.py --engine smollm2 --batches 1,16 [--decode-steps 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from workers.engines.base import SeqInput, needs_history  # noqa: E402
from workers.engines.llama.penalties import LogitAdjuster  # noqa: E402
from workers.kv_pool import KVPool  # noqa: E402
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


def engine_decode_tokens_per_s(engine: Any, batch: int, prompt_len: int, steps: int,
                               params: SamplingParams) -> float:
    """Prefill ``batch`` random prompts, then time ``steps`` decode steps; tokens/s of the decode."""
    info = engine.info
    page_size = 16
    pool = KVPool(num_layers=info.num_layers, num_pages=batch * -(-(prompt_len + steps + 1) // page_size),
                  page_size=page_size, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=info.kv_dtype)
    engine.bind(pool)
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, info.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    pages = [pool.alloc(pool.pages_for(prompt_len + steps + 1)) or [] for _ in prompts]
    outputs = [[o.token_id or 0] for o in engine.forward(
        [SeqInput(i, pages[i], 0, p, True, params, 0, p) for i, p in enumerate(prompts)])]
    history = needs_history(params)
    t0 = time.perf_counter()
    for step in range(steps):
        seqs = [SeqInput(i, pages[i], prompt_len + step, [outputs[i][-1]], True, params, step + 1,
                         prompts[i] + outputs[i] if history else None) for i in range(batch)]
        for i, out in enumerate(engine.forward(seqs)):
            outputs[i].append(out.token_id or 0)
    elapsed = time.perf_counter() - t0
    for i in range(batch):
        engine.forget(i)
    return batch * steps / elapsed


def run_engine(name: str, batches: list[int], prompt_len: int, steps: int, repeats: int) -> None:
    from workers.engines.base import EngineOptions
    from workers.engines.llama import TorchEngine

    model = None
    if name == "tiny":
        import tempfile

        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
        torch.manual_seed(0)
        model = tempfile.mkdtemp(prefix="bench-penalties-")
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model)
    engine = TorchEngine(EngineOptions(model=model))
    vocab = engine.info.vocab_size
    plain = SamplingParams(temperature=0.0, max_new_tokens=10**6)
    adjusted = SamplingParams(temperature=0.0, max_new_tokens=10**6, repetition_penalty=1.2, presence_penalty=0.5,
                              frequency_penalty=0.3, logit_bias={t: 2.0 for t in range(3, vocab, vocab // 8)},
                              min_new_tokens=steps)
    print(f"\n{name}: decode tokens/s (median of {repeats}), prompt {prompt_len} tokens, {steps} steps, greedy")
    print(f"{'batch':>5} {'plain':>10} {'adjusted':>10} {'ratio':>7}")
    for batch in batches:
        engine_decode_tokens_per_s(engine, batch, prompt_len, 2, plain)  # warm-up
        runs: dict[str, list[float]] = {"plain": [], "adjusted": []}
        for _ in range(repeats):  # interleaved, so a busy moment of the machine hits both alike
            runs["plain"].append(engine_decode_tokens_per_s(engine, batch, prompt_len, steps, plain))
            runs["adjusted"].append(engine_decode_tokens_per_s(engine, batch, prompt_len, steps, adjusted))
        base, with_adj = statistics.median(runs["plain"]), statistics.median(runs["adjusted"])
        print(f"{batch:>5} {base:>10.1f} {with_adj:>10.1f} {with_adj / base:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--history", type=int, default=512)
    parser.add_argument("--engine", choices=("tiny", "smollm2"), default=None)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="engine runs per setting (interleaved)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"vocab {VOCAB}, history {args.history} tokens, median of {args.steps} steps, 1 thread")
    print(f"{'batch':>5} {'adjust µs':>10} {'first µs':>10} {'baseline µs':>12} {'argmax µs':>10} "
          f"{'adjust/baseline':>16}")
    for batch in (int(b) for b in args.batches.split(",")):
        r = run(batch, args.steps, args.history)
        print(f"{batch:>5} {r['adjust_us']:>10.0f} {r['first_us']:>10.0f} {r['baseline_us']:>12.0f} "
              f"{r['argmax_us']:>10.0f} {r['adjust_us'] / r['baseline_us']:>15.2f}x")
    if args.engine:
        run_engine(args.engine, [int(b) for b in args.batches.split(",")], args.prompt_len, args.decode_steps,
                   args.repeats)


if __name__ == "__main__":
    main()
