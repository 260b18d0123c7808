"""Sampling: filters, seeded reproducibility (including across a PD split), and the distribution."""

from __future__ import annotations

import random

import pytest
import torch
from llama_harness import Request, run_requests

from workers.engines.llama.sampling import derive_seed, filtered_logits, generator_for, sample, token_logprobs
from workers.protocol import SamplingParams


def _logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=gen) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = _logits()
    best = int(torch.argmax(logits))
    gen = torch.Generator().manual_seed(0)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=5.0, min_p=1.0),
    ):
        assert {sample(logits, params, gen) for _ in range(20)} == {best}, params


def test_top_k_top_p_min_p_keep_the_right_sets() -> None:
    logits = _logits(1)
    order = torch.argsort(logits, descending=True).tolist()
    kept = torch.isfinite(filtered_logits(logits, SamplingParams(top_k=5)))
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:5])

    probs = logits.softmax(-1)
    cum = probs[order].cumsum(0)
    need = int((cum < 0.6).sum()) + 1  # smallest prefix covering 0.6
    kept = torch.isfinite(filtered_logits(logits, SamplingParams(top_p=0.6)))
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:need])

    kept = torch.isfinite(filtered_logits(logits, SamplingParams(min_p=0.1)))
    assert set(torch.nonzero(kept).flatten().tolist()) == {i for i in range(64) if probs[i] >= 0.1 * probs.max()}


def test_samples_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.7)
    gen = torch.Generator().manual_seed(1234)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(n)]), minlength=6)
    expected = (logits / 0.7).softmax(-1)
    assert (counts / n - expected).abs().max().item() < 0.03  # ~4 standard errors at n=4000


def test_derive_seed_depends_on_seed_and_position() -> None:
    seeds = {derive_seed(s, i) for s in (0, 1, 2**40, -5) for i in range(50)}
    assert len(seeds) == 200
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 3) == derive_seed(7, 3)


def test_token_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(2)
    ref = torch.log_softmax(logits, -1)
    lp, top = token_logprobs(logits, 5, 3)
    assert lp == pytest.approx(float(ref[5]))
    assert top is not None and [t.token_id for t in top] == torch.topk(ref, 3).indices.tolist()
    assert token_logprobs(logits, 5, 0)[1] is None


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_seeded_sampling_reproduces_in_a_batch_and_across_a_pd_split(tiny_model, make_engine) -> None:
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=200, seed=42)
    prompt = _prompt(1, 11)

    single = make_engine(model.path)
    alone = Request(rid=1, prompt=prompt, max_new_tokens=12, params=params)
    run_requests(single.engine, single.pool, [alone])

    again = make_engine(model.path)
    # Same request, now in a batch with other sampled requests and chunked differently.
    crowded = Request(rid=9, prompt=prompt, max_new_tokens=12, params=params, chunks=[4, 7])
    noise = [Request(rid=i, prompt=_prompt(i, 6), max_new_tokens=12, params=SamplingParams()) for i in (2, 3)]
    run_requests(again.engine, again.pool, [*noise, crowded])
    assert crowded.outputs == alone.outputs

    other_seed = make_engine(model.path)
    changed = Request(
        rid=1, prompt=prompt, max_new_tokens=12, params=SamplingParams(**{**_as_dict(params), "seed": 43})
    )
    run_requests(other_seed.engine, other_seed.pool, [changed])
    assert changed.outputs != alone.outputs

    # PD: output 0 sampled on the prefill engine, outputs 1.. on a decode engine with copied KV.
    prefill, decode = make_engine(model.path), make_engine(model.path)
    p_req = Request(rid=4, prompt=prompt, max_new_tokens=1, params=params)
    run_requests(prefill.engine, prefill.pool, [p_req])
    assert p_req.page_ids is not None and p_req.outputs is not None
    decode.pool.alloc(3)
    d_pages = decode.pool.alloc(decode.pool.pages_for(len(prompt) + 12))
    assert d_pages is not None
    n = prefill.pool.pages_for(len(prompt))
    for src_buf, dst_buf in zip(prefill.pool.kv_buffers(), decode.pool.kv_buffers(), strict=True):
        dst_buf[d_pages[:n]] = src_buf[p_req.page_ids[:n]]
    d_req = Request(
        rid=4,
        prompt=prompt,
        max_new_tokens=12,
        params=params,
        page_ids=d_pages,
        num_cached=len(prompt),
        chunks=[],
        outputs=list(p_req.outputs),
    )
    run_requests(decode.engine, decode.pool, [d_req])
    assert d_req.outputs == alone.outputs


def _as_dict(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_a_migrated_request_draws_what_the_original_would_have() -> None:
    """A stream resubmitted after k outputs (``output_offset=k``) samples output n with the generator the
    original request would have used for output k + n."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    original = SamplingParams(temperature=1.0, seed=1234)
    migrated = SamplingParams(temperature=1.0, seed=1234, output_offset=5)
    fallback = torch.Generator().manual_seed(0)
    for n in range(4):
        a = sample(logits, original, generator_for(original, 5 + n, fallback))
        b = sample(logits, migrated, generator_for(migrated, n, fallback))
        assert a == b
    draws = {sample(logits, original, generator_for(original, i, fallback)) for i in range(16)}
    assert len(draws) > 1, "different positions draw differently (the check above can fail)"
