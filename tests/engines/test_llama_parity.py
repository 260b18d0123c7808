"""The torch engine against transformers on tiny random Llama / Qwen2 / Qwen3 models (float32).

Every test compares per-step logits (within 1e-4) and greedy tokens (identical) with
``transformers.generate`` on the same weights, for the batch shapes a scheduler produces.
"""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest
import torch
from llama_harness import Request, reference_greedy, run_requests

VARIANTS = ["llama", "llama_tied", "qwen2", "qwen3"]
ATOL = 1e-4


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def _assert_matches(model, req: Request) -> None:
    tokens, logits = reference_greedy(model.reference, req.prompt, req.max_new_tokens)
    assert req.outputs == tokens, f"rid {req.rid}: greedy tokens differ"
    assert req.logits is not None and len(req.logits) == len(logits)
    for step, (ours, ref) in enumerate(zip(req.logits, logits, strict=True)):
        err = (ours - ref).abs().max().item()
        assert err < ATOL, f"rid {req.rid} step {step}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_length_batch(variant, tiny_model, make_engine) -> None:
    model = tiny_model(variant)
    eut = make_engine(model.path)
    requests = [
        Request(rid=1, prompt=_prompt(1, 5), max_new_tokens=6),
        Request(rid=2, prompt=_prompt(2, 13), max_new_tokens=6),
        Request(rid=3, prompt=_prompt(3, 1), max_new_tokens=6),
        Request(rid=4, prompt=_prompt(4, 8), max_new_tokens=3),
    ]
    steps = run_requests(eut.engine, eut.pool, requests)
    assert len(steps[0]) == 4  # all four prefills in one step
    for req in requests:
        _assert_matches(model, req)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_in_mixed_batches(variant, tiny_model, make_engine) -> None:
    model = tiny_model(variant)
    eut = make_engine(model.path)
    requests = [
        Request(rid=1, prompt=_prompt(11, 23), max_new_tokens=5, chunks=[7, 7, 9]),
        Request(rid=2, prompt=_prompt(12, 6), max_new_tokens=6),
        Request(rid=3, prompt=_prompt(13, 8), max_new_tokens=4, chunks=[3, 5], start_step=1),
        Request(rid=4, prompt=_prompt(14, 30), max_new_tokens=3, chunks=[1, 16, 13], start_step=2),
    ]
    steps = run_requests(eut.engine, eut.pool, requests)
    # Step 1 mixes a decode (rid 2), a middle chunk (rid 1) and a first chunk (rid 3).
    assert {(rid, n) for rid, n, _ in steps[1]} == {(1, 7), (2, 1), (3, 3)}
    for req in requests:
        _assert_matches(model, req)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefix_cache_hit(variant, tiny_model, make_engine) -> None:
    model = tiny_model(variant)
    eut = make_engine(model.path, page_size=4)
    shared = _prompt(21, 12)
    first = Request(rid=1, prompt=shared + _prompt(22, 3), max_new_tokens=2)
    run_requests(eut.engine, eut.pool, [first])
    assert first.page_ids is not None
    # A later request whose first 12 tokens (3 full pages) hit the cache: it reuses those pages
    # read-only and prefills only its own suffix, next to a request prefilling from scratch.
    suffix = _prompt(23, 9)
    fresh = eut.pool.alloc(eut.pool.pages_for(len(shared) + len(suffix) + 4) - 3)
    assert fresh is not None
    hit = Request(
        rid=2,
        prompt=shared + suffix,
        max_new_tokens=4,
        page_ids=first.page_ids[:3] + fresh,
        num_cached=len(shared),
        chunks=[4, 5],
    )
    other = Request(rid=3, prompt=_prompt(24, 10), max_new_tokens=4)
    run_requests(eut.engine, eut.pool, [hit, other])
    _assert_matches(model, first)
    _assert_matches(model, hit)
    _assert_matches(model, other)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pd_handoff_between_pools(variant, tiny_model, make_engine) -> None:
    """Prefill on engine A, copy the prompt's pages into other page ids of pool B, decode on B."""
    model = tiny_model(variant)
    prefill = make_engine(model.path, num_pages=32, page_size=4)
    decode = make_engine(model.path, num_pages=48, page_size=4)
    prompt = _prompt(31, 14)
    total = 8
    p_req = Request(rid=7, prompt=prompt, max_new_tokens=1, chunks=[6, 8])
    run_requests(prefill.engine, prefill.pool, [p_req])
    assert p_req.outputs is not None and p_req.page_ids is not None

    decode.pool.alloc(5)  # make B's ids differ from A's
    d_pages = decode.pool.alloc(decode.pool.pages_for(len(prompt) + total))
    assert d_pages is not None
    assert d_pages[: len(p_req.page_ids)] != p_req.page_ids
    num_prompt_pages = prefill.pool.pages_for(len(prompt))
    for src_buf, dst_buf in zip(prefill.pool.kv_buffers(), decode.pool.kv_buffers(), strict=True):
        for src, dst in zip(p_req.page_ids[:num_prompt_pages], d_pages[:num_prompt_pages], strict=True):
            dst_buf[dst] = src_buf[src]

    d_req = Request(
        rid=7,
        prompt=prompt,
        max_new_tokens=total,
        page_ids=d_pages,
        num_cached=len(prompt),
        chunks=[],
        outputs=list(p_req.outputs),
    )
    run_requests(decode.engine, decode.pool, [d_req])
    tokens, logits = reference_greedy(model.reference, prompt, total)
    assert d_req.outputs == tokens
    assert d_req.logits is not None
    ours = [p_req.logits[0], *d_req.logits] if p_req.logits else []
    for step, (a, b) in enumerate(zip(ours, logits, strict=True)):
        assert (a - b).abs().max().item() < ATOL, f"step {step}"


def _reference_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        ref = torch.log_softmax(model.reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.mark.parametrize("pass_all_ids", [True, False])
def test_prompt_logprobs_across_chunks(pass_all_ids, tiny_model, make_engine) -> None:
    from workers.protocol import SamplingParams

    model = tiny_model("qwen3")
    eut = make_engine(model.path, page_size=4)
    prompt = _prompt(41, 17)
    params = SamplingParams(temperature=0.0, prompt_logprobs=True)
    # Chunk 2 starts after cached positions: its first entry comes from the carried row of chunk
    # 1 (or, with all_token_ids, either way). A second request interleaves to mix the batches.
    req = Request(rid=1, prompt=prompt, max_new_tokens=2, chunks=[5, 1, 11], params=params, pass_all_ids=pass_all_ids)
    other = Request(rid=2, prompt=_prompt(42, 9), max_new_tokens=3, chunks=[4, 5], params=params)
    run_requests(eut.engine, eut.pool, [req, other])
    for r in (req, other):
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(r.prompt)
        assert math.isnan(r.prompt_logprobs[0])  # nothing precedes position 0
        expected = _reference_prompt_logprobs(model, r.prompt)
        assert all(abs(a - b) < ATOL for a, b in zip(r.prompt_logprobs[1:], expected, strict=True))
    assert not eut.engine._prompt_carry  # nothing kept once the prompts finished
    # aborted after its first chunk: what was carried for its next one goes with it
    from workers.engines.base import SeqInput

    pages = eut.pool.alloc(eut.pool.pages_for(len(prompt)))
    assert pages is not None
    eut.engine.forward([SeqInput(3, pages, 0, prompt[:5], False, params)])
    assert eut.engine._prompt_carry
    eut.engine.forget(3)
    assert not eut.engine._prompt_carry


@pytest.mark.parametrize("start", [1, 4, 5, 6, 16])
def test_prompt_logprobs_from_a_start(start, tiny_model, make_engine) -> None:
    """``prompt_logprobs_start``: positions before it are NaN (not scored), those from it on as when the whole
    prompt's are asked, whichever chunk they fall in (the chunk ending right before it carries its row)."""
    from workers.protocol import SamplingParams

    model = tiny_model("qwen3")
    eut = make_engine(model.path, page_size=4)
    prompt = _prompt(41, 17)
    params = SamplingParams(temperature=0.0, prompt_logprobs=True, prompt_logprobs_start=start)
    req = Request(rid=1, prompt=prompt, max_new_tokens=2, chunks=[5, 1, 11], params=params, pass_all_ids=False)
    run_requests(eut.engine, eut.pool, [req])
    got = req.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert all(math.isnan(v) for v in got[:start])
    expected = _reference_prompt_logprobs(model, prompt)  # (position i's at i - 1)
    assert all(abs(a - b) < ATOL for a, b in zip(got[start:], expected[start - 1:], strict=True)), got
    assert not eut.engine._prompt_carry


def test_a_carried_row_is_not_evicted_by_its_own_batch(tiny_model, make_engine, monkeypatch) -> None:
    """With the carry table full, a chunk keeping its last row evicts the oldest kept one: never one that a
    later sequence of the same batch is about to use (its first prompt logprob came back as NaN)."""
    import workers.engines.llama.engine as engine_module
    from workers.protocol import SamplingParams

    monkeypatch.setattr(engine_module, "_MAX_PROMPT_CARRY", 1)
    model = tiny_model("llama")
    eut = make_engine(model.path, page_size=4)
    params = SamplingParams(temperature=0.0, prompt_logprobs=True)
    reqs = [Request(rid=i, prompt=_prompt(60 + i, 12), max_new_tokens=1, chunks=[4, 4, 4], params=params)
            for i in range(2)]
    run_requests(eut.engine, eut.pool, reqs)
    for r in reqs:
        assert r.prompt_logprobs is not None and math.isnan(r.prompt_logprobs[0])
        expected = _reference_prompt_logprobs(model, r.prompt)
        assert all(abs(a - b) < ATOL for a, b in zip(r.prompt_logprobs[1:], expected, strict=True)), r.prompt_logprobs


def test_prompt_logprobs_on_prefix_hit(tiny_model, make_engine) -> None:
    from workers.protocol import SamplingParams

    model = tiny_model("llama")
    eut = make_engine(model.path, page_size=4)
    shared = _prompt(43, 8)
    first = Request(rid=1, prompt=[*shared, 7, 7], max_new_tokens=1)
    run_requests(eut.engine, eut.pool, [first])
    assert first.page_ids is not None
    params = SamplingParams(temperature=0.0, prompt_logprobs=True)
    prompt = shared + _prompt(44, 6)
    expected = _reference_prompt_logprobs(model, prompt)
    for pass_all_ids in (True, False):
        fresh = eut.pool.alloc(3)
        assert fresh is not None
        cached_before = [buf.copy() for buf in eut.pool.kv_buffers()]
        hit = Request(
            rid=5,
            prompt=prompt,
            max_new_tokens=1,
            page_ids=first.page_ids[:2] + fresh,
            num_cached=8,
            params=params,
            pass_all_ids=pass_all_ids,
        )
        run_requests(eut.engine, eut.pool, [hit])
        assert hit.prompt_logprobs is not None and len(hit.prompt_logprobs) == 6
        got = hit.prompt_logprobs
        if pass_all_ids:  # position 7 re-run from all_token_ids
            assert all(abs(a - b) < ATOL for a, b in zip(got, expected[7:], strict=True))
        else:  # nothing to condition the first entry on
            assert math.isnan(got[0])
            assert all(abs(a - b) < ATOL for a, b in zip(got[1:], expected[8:], strict=True))
        # Positions from 10 on wanted: the cached position 7 is not re-run, 8 and 9 are not scored.
        tail = Request(rid=6, prompt=prompt, max_new_tokens=1, page_ids=first.page_ids[:2] + fresh, num_cached=8,
                       params=msgspec.structs.replace(params, prompt_logprobs_start=10), pass_all_ids=pass_all_ids)
        run_requests(eut.engine, eut.pool, [tail])
        assert tail.prompt_logprobs is not None and all(math.isnan(v) for v in tail.prompt_logprobs[:2])
        assert all(abs(a - b) < ATOL for a, b in zip(tail.prompt_logprobs[2:], expected[9:], strict=True))
        # The shared pages were only read: the re-run row did not rewrite position 7.
        for before, after in zip(cached_before, eut.pool.kv_buffers(), strict=True):
            for page in first.page_ids[:2]:
                assert np.array_equal(before[page], after[page])


def test_prefill_and_decode_sample_logprobs(tiny_model, make_engine) -> None:
    from workers.engines.base import SeqInput
    from workers.protocol import SamplingParams

    model = tiny_model("llama")
    eut = make_engine(model.path)
    prompt = _prompt(51, 9)
    pages = eut.pool.alloc(4)
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4)
    out = eut.engine.forward([SeqInput(1, pages, 0, prompt, True, params)])[0]
    with torch.no_grad():
        ref = torch.log_softmax(model.reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    top = torch.topk(ref, 4)
    assert out.token_id == int(top.indices[0])
    assert out.logprob is not None and abs(out.logprob - float(top.values[0])) < ATOL
    assert out.top_logprobs is not None
    assert [t.token_id for t in out.top_logprobs] == top.indices.tolist()
    for t, v in zip(out.top_logprobs, top.values.tolist(), strict=True):
        assert abs(t.logprob - v) < ATOL
