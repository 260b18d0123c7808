"""Torch engine throughput: prefill and decode tokens/s at several batch sizes, next to transformers.

For each model (a tiny random Llama built here, and the embedded SmolLM2-135M-Instruct) and each
batch size B, B equal-length random prompts of P tokens are
- prefilled by our engine in one step (tokens/s = B*P / step time), then decoded for N steps
  (tokens/s = B*N / time);
- run through ``transformers.generate`` (greedy, no EOS, ``max_new_tokens=N+1``) with a streamer
  timing each step: prefill tokens/s = B*P / (first token - start), decode = B*N / the rest.
Both run in this process with the same thread count, one after the other; figures are the median
of ``--repeats`` runs. Nothing here is asserted: it prints a table.

    .venv/bin/python loadtests/bench_engine.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.llama import TorchEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams

PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)


def build_tiny(out_dir: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ours(engine: TorchEngine, prompts: list[list[int]], steps: int, repeats: int) -> tuple[float, float]:
    batch = len(prompts)
    length = len(prompts[0])
    info = engine.info
    pool = KVPool(
        num_layers=info.num_layers,
        num_pages=batch * (-(-(length + steps + 1) // PAGE_SIZE)),
        page_size=PAGE_SIZE,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.kv_dtype,
    )
    engine.bind(pool)
    pages = [pool.alloc(pool.pages_for(length + steps + 1)) or [] for _ in prompts]
    first: list[int] = []

    def prefill() -> None:
        out = engine.forward([SeqInput(i, pages[i], 0, p, True, GREEDY) for i, p in enumerate(prompts)])
        first[:] = [o.token_id or 0 for o in out]

    def decode() -> None:
        last = list(first)
        for step in range(steps):
            batch_in = [
                SeqInput(i, pages[i], length + step, [last[i]], True, GREEDY, num_generated=step + 1)
                for i in range(batch)
            ]
            last = [o.token_id or 0 for o in engine.forward(batch_in)]

    t_prefill = median_time(prefill, repeats)
    t_decode = median_time(decode, repeats)
    return batch * length / t_prefill, batch * steps / t_decode


def bench_transformers(model: Any, prompts: list[list[int]], steps: int, repeats: int) -> tuple[float, float]:
    """One ``generate(max_new_tokens=steps + 1)`` per repeat, timed per token by a streamer.

    ``generate`` hands the streamer the prompt before the prefill and each new token as it is
    sampled, so prefill time = first token - prompt, decode time = last token - first token.
    """
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    prefill_times, decode_times = [], []
    for _ in range(repeats):
        clock = Clock()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False, streamer=clock)
        assert len(clock.times) == steps + 2, "streamer saw an unexpected number of steps"
        prefill_times.append(clock.times[1] - clock.times[0])
        decode_times.append(clock.times[-1] - clock.times[1])
    batch, length = ids.shape
    return batch * length / statistics.median(prefill_times), batch * steps / statistics.median(decode_times)


def run_model(name: str, path: str, batches: list[int], length: int, steps: int, repeats: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    engine = TorchEngine(EngineOptions(model=path, num_threads=torch.get_num_threads()))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    vocab = engine.info.vocab_size
    gen = torch.Generator().manual_seed(0)
    # Warm both paths once (allocator, lazy inits) before timing.
    warm = [torch.randint(3, vocab, (8,), generator=gen).tolist()]
    bench_ours(engine, warm, 2, 1)
    bench_transformers(ref, warm, 2, 1)
    rows = []
    for batch in batches:
        prompts = [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]
        ours_p, ours_d = bench_ours(engine, prompts, steps, repeats)
        hf_p, hf_d = bench_transformers(ref, prompts, steps, repeats)
        row = (
            f"| {name} | {batch} | {length} | {ours_p:,.0f} | {hf_p:,.0f} | {ours_p / hf_p:.2f}x "
            f"| {ours_d:,.0f} | {hf_d:,.0f} | {ours_d / hf_d:.2f}x |"
        )
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short settings (one repeat, short prompts)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="decode steps")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="tiny,smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    length = args.prompt_len or (64 if args.quick else 256)
    steps = args.steps or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {args.threads} thread(s), prompt {length} tokens, {steps} decode steps")
    print(
        "| model | batch | prompt | prefill tok/s (ours) | prefill tok/s (HF generate) | ratio "
        "| decode tok/s (ours) | decode tok/s (HF generate) | ratio |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in models:
            run_model("tiny llama (h64, 2 layers)", build_tiny(tmp), batches, length, steps, repeats)
        if "smollm2" in models:
            from workers.engines.llama.gguf_convert import default_model_dir

            run_model("SmolLM2-135M", default_model_dir(), batches, length, steps, repeats)


if __name__ == "__main__":
    main()
