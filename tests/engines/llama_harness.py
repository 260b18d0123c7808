"""Test harness for the torch engine: drive requests step by step like a scheduler; reference output."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workers.engines.base import SeqInput
from workers.engines.llama import TorchEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams


@dataclass
class Request:
    """One request driven through an engine step by step, as a scheduler would."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    chunks: list[int] | None = None  # prefill chunk sizes after the cached prefix; default one chunk
    page_ids: list[int] | None = None
    num_cached: int = 0  # prompt positions whose KV is already in page_ids (prefix hit / PD)
    start_step: int = 0
    params: Any = None  # SamplingParams; greedy when None
    pass_all_ids: bool = True  # set SeqInput.all_token_ids (the scheduler may leave it None)
    outputs: list[int] | None = None
    logits: list[Any] | None = None
    prompt_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        self.outputs = [] if self.outputs is None else self.outputs
        self.logits = []
        self.prompt_logprobs = []


def run_requests(engine: TorchEngine, pool: KVPool, requests: list[Request]) -> list[list[Any]]:
    """Drive ``requests`` to completion in mixed batches; returns the batch composition per step.

    Prefill chunks and decode tokens of different requests share steps. Pages are allocated here
    for requests without a page table. A request that starts with outputs already (a PD hand-off)
    continues decoding from its last output.
    """
    for req in requests:
        if req.page_ids is None:
            pages = pool.alloc(pool.pages_for(len(req.prompt) + req.max_new_tokens))
            assert pages is not None, "test pool too small"
            req.page_ids = pages
    state = {
        r.rid: {
            "pos": r.num_cached,
            "chunks": list(r.chunks if r.chunks is not None else [len(r.prompt) - r.num_cached]),
        }
        for r in requests
    }
    steps: list[list[Any]] = []
    step = 0
    while True:
        batch, owners = [], []
        for req in requests:
            assert req.outputs is not None and req.page_ids is not None
            st = state[req.rid]
            if step < req.start_step or len(req.outputs) >= req.max_new_tokens:
                continue
            params = req.params or SamplingParams(temperature=0.0)
            if st["chunks"]:
                size = st["chunks"].pop(0)
                tokens = req.prompt[st["pos"] : st["pos"] + size]
                sample = not st["chunks"]
            else:
                tokens = [req.outputs[-1]]
                sample = True
            batch.append(
                SeqInput(
                    rid=req.rid,
                    page_ids=req.page_ids,
                    num_cached=st["pos"],
                    token_ids=tokens,
                    sample=sample,
                    params=params,
                    num_generated=len(req.outputs),
                    all_token_ids=req.prompt + req.outputs if req.pass_all_ids else None,
                )
            )
            owners.append(req)
        if not batch:
            if all(len(r.outputs or []) >= r.max_new_tokens for r in requests):
                break
            step += 1
            continue
        outs = engine.forward(batch)
        steps.append([(s.rid, len(s.token_ids), s.num_cached) for s in batch])
        for seq, out, req, logits in zip(batch, outs, owners, engine.last_logits, strict=True):
            assert req.outputs is not None and req.logits is not None and req.prompt_logprobs is not None
            state[req.rid]["pos"] += len(seq.token_ids)
            if out.prompt_logprobs is not None:
                req.prompt_logprobs.extend(out.prompt_logprobs)
            elif seq.params.prompt_logprobs and not req.outputs:  # (a chunk before ``prompt_logprobs_start``)
                req.prompt_logprobs.extend([math.nan] * len(seq.token_ids))
            if seq.sample:
                assert out.token_id is not None and logits is not None
                req.outputs.append(out.token_id)
                req.logits.append(logits)
        step += 1
    return steps


def reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[Any]]:
    """transformers' greedy tokens and per-step raw logits for one prompt."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].float() for step in out.logits]
