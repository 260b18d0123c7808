"""Prompt logprobs on ``/generate`` (SGLang's ``return_logprob`` + ``logprob_start_len``), the way an RL loop asks
for them: one long shared instruction, a short new suffix per request, one output token, ``return_logprob`` on.

Against the same SmolLM2 deployment (torch engine, one PD pair and one combined worker; ``tests/pdtest.py``'s
``start_smollm2``), requests alternate between
- **whole**: ``logprob_start_len: 0``: every prompt position scored, and no cached page shared (what every
  ``return_logprob`` request did before ``logprob_start_len`` was honoured), and
- **default**: no ``logprob_start_len`` (SGLang's -1: the prompt's last position alone), so the shared
  instruction's pages come from the prefix cache.
Printed per mode and route: latency p50 / mean over the requests and the prompt tokens served from the cache.

    .venv/bin/python loadtests/bench_prompt_logprobs.py [--requests 12] [--prefix-words 500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from pdtest import Procs, SmolDeployment, start_smollm2  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

INSTRUCTION = ("grade the answer below for correctness and style, explaining each point briefly; the rubric weighs "
               "facts first, then reasoning, then clarity of the language used")


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="requests per mode and route")
    parser.add_argument("--prefix-words", type=int, default=500, help="words of the shared instruction")
    args = parser.parse_args()
    words = INSTRUCTION.split()
    instruction = " ".join(words[i % len(words)] for i in range(args.prefix_words))
    with tempfile.TemporaryDirectory(prefix="bench-prompt-logprobs-") as tmp:
        procs = Procs(Path(tmp))
        try:
            run(start_smollm2(procs, chunk_size=256), instruction, args.requests)
        finally:
            procs.stop_all()


def run(deployment: SmolDeployment, instruction: str, requests: int) -> None:
    for name, base in (("PD", deployment.pd_url), ("combined", deployment.both_url)):
        times: dict[str, list[float]] = {"whole": [], "default": []}
        cached: dict[str, list[int]] = {"whole": [], "default": []}
        prompt = 0
        with httpx.Client(timeout=600) as client:
            for i in range(-1, requests):  # (the first pair warms up and fills the cache: not counted)
                for mode in ("whole", "default") if i % 2 else ("default", "whole"):
                    body = {"text": f"{instruction}\nAnswer {i} ({mode}): the sky is blue because of sunlight.",
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True}
                    if mode == "whole":
                        body["logprob_start_len"] = 0
                    t0 = time.perf_counter()
                    r = client.post(f"{base}/generate", json=body)
                    elapsed = time.perf_counter() - t0
                    r.raise_for_status()
                    if i >= 0:
                        meta = r.json()["meta_info"]
                        times[mode].append(elapsed)
                        cached[mode].append(meta["cached_tokens"])
                        prompt = meta["prompt_tokens"]
        for mode in ("whole", "default"):
            p50 = statistics.median(times[mode]) * 1e3
            print(f"{name:9s} {mode:8s} prompt {prompt} tokens: latency p50 {p50:7.1f} ms"
                  f" mean {statistics.fmean(times[mode]) * 1e3:7.1f} ms, cached tokens mean "
                  f"{statistics.fmean(cached[mode]):6.1f}")
        ratio = statistics.median(times["default"]) / statistics.median(times["whole"])
        print(f"{name:9s} default / whole latency (p50): {ratio:.3f}")

if __name__ == "__main__":
    main()
