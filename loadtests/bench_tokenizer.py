"""The gateway's tokenizer work per request with a real model's tokenizer, each next to its baseline.

With the byte tokenizer of the fast and sim workers (every other benchmark) tokenizing costs next to
nothing; with a model's (``pd-cluster`` and ``make run`` use SmolLM2's) it is the largest item of a
request. One process, one thread, best of ``--repeat`` runs of each, in µs:

- ``apply_chat_template`` through ``PieceEncoder`` (pieces between added tokens, kept) against
  encoding the rendered text whole: a one-message chat and a 20-turn conversation, each with a new
  last message every request (so that only it is new);
- incremental detokenization through ``DecodeStream`` against the Python window algorithm: pushes of 1
  id (a stream) and of 15 (a gathered whole response), per token;
- ``decode([id])`` kept per id against the tokenizer's decode (logprob entries).

    .venv/bin/python loadtests/bench_tokenizer.py [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from gateway.hf_tokenizer import HFTokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. Serving engines stream tokens to their clients — "
        "ünïcödé, 東京, 12345 and 🎉 included. ") * 8


def best_us(fn: Callable[[], int], repeat: int) -> float:
    """Best of ``repeat`` runs of ``fn`` (which returns how many units it did), µs per unit."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        units = fn()
        best = min(best, (time.perf_counter() - started) / units * 1e6)
    return best


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} * 17? Explain, ünïcödé 東京."})
        messages.append({"role": "assistant", "content": f"{i} * 17 = {i * 17}. First, multiply... " * 5})
    messages.append({"role": "user", "content": "Thanks!"})
    return messages


def chat_us(tok: HFTokenizer, messages: list[dict[str, Any]], n: int, repeat: int, pieces: bool) -> float:
    saved = tok._pieces
    if not pieces:
        tok._pieces = None
    counter = [0]

    def run() -> int:
        for _ in range(n):
            counter[0] += 1
            fresh = [*messages[:-1], {**messages[-1], "content": f"{messages[-1]['content']} #{counter[0]}"}]
            tok.apply_chat_template(fresh)
        return n

    try:
        return best_us(run, repeat)
    finally:
        tok._pieces = saved


def detok_us(tok: HFTokenizer, ids: list[int], size: int, repeat: int, stream: bool) -> float:
    def run() -> int:
        for _ in range(20):
            decoder = tok.decoder()
            if not stream:
                decoder._stream = None  # type: ignore[attr-defined]
            for k in range(0, len(ids), size):
                decoder.push(ids[k:k + size])
            decoder.flush()
        return 20 * len(ids)

    return best_us(run, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a model directory (default: SmolLM2's, converted once)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.tokenizer is None:
        from workers.engines.llama.gguf_convert import default_model_dir

        args.tokenizer = default_model_dir()
    tok = HFTokenizer.from_dir(args.tokenizer)
    print(f"tokenizer {tok.name}; pieces {'on' if tok._pieces is not None else 'off (its pieces differ)'}")
    one = [{"role": "user", "content": "Write a haiku about the sea, please."}]
    long = conversation(10)
    rows: list[tuple[str, float, float]] = []
    if tok.chat_template is not None:
        n_long = len(tok.apply_chat_template(long))
        rows.append(("apply_chat_template, 1 message, new text (µs/request)",
                     chat_us(tok, one, 300, args.repeat, False), chat_us(tok, one, 300, args.repeat, True)))
        rows.append((f"apply_chat_template, 20 turns, {n_long} tokens, new last (µs/request)",
                     chat_us(tok, long, 30, args.repeat, False), chat_us(tok, long, 30, args.repeat, True)))
    ids = tok.encode(TEXT)
    for size in (1, 15):
        rows.append((f"detokenize, pushes of {size} id{'s' if size > 1 else ''} (µs/token)",
                     detok_us(tok, ids, size, args.repeat, False), detok_us(tok, ids, size, args.repeat, True)))
    raw = tok._tok

    def raw_decode() -> int:
        for i in ids:
            raw.decode([i], skip_special_tokens=True)
        return len(ids)

    def kept_decode() -> int:
        for i in ids:
            tok.decode([i])
        return len(ids)

    rows.append(("decode([id]) (µs/call)", best_us(raw_decode, args.repeat), best_us(kept_decode, args.repeat)))
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'baseline':>9}  {'gateway':>9}  ratio")
    for label, base, ours in rows:
        print(f"{label:{width}}  {base:9.2f}  {ours:9.2f}  {ours / base:5.3f}")
    print("baselines: the rendered chat encoded whole; the Python window algorithm; the tokenizer's decode")


if __name__ == "__main__":
    main()
