"""Choosing the next token from logits, and the logprobs reported with it.

Filters apply in this order: temperature, top-k, top-p (nucleus), min-p (relative to the most
likely token). Temperature 0 is greedy (argmax). Reported logprobs (``logprob``, ``top_logprobs``,
prompt logprobs) are from the model's raw distribution, ``log_softmax(logits)``, before any filter.

Seeded requests draw from a generator seeded with ``derive_seed(seed, output_index)``, so the
token at output position n depends only on the request seed, n and the logits: a request split
across a prefill engine (output 0) and a decode engine (outputs 1..) samples what one engine would.
"""

from __future__ import annotations

import torch

from workers.protocol import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is greedy


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, output_index: int) -> int:
    """A well-mixed 63-bit generator seed for output position ``output_index`` of a request."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64)) >> 1


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= GREEDY_TEMPERATURE or params.top_k == 1


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits ``[V]`` with filtered-out tokens at -inf."""
    scores = logits.to(torch.float32) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        # Drop a token when the tokens before it already cover top_p (the first is always kept).
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[V]`` (float32) under ``params``."""
    if is_greedy(params):
        return int(torch.argmax(logits))
    probs = filtered_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generator_for(params: SamplingParams, output_index: int, fallback: torch.Generator) -> torch.Generator:
    """The seeded generator for this output position, or the engine's own for unseeded requests."""
    if params.seed is None:
        return fallback
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(params.seed, output_index + params.output_offset))
    return gen


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> tuple[float, list[TokenLogprob] | None]:
    """The raw logprob of ``token_id`` and the ``num_top`` most likely tokens (None when 0)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = float(logprobs[token_id])
    if num_top <= 0:
        return chosen, None
    values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
    top = [TokenLogprob(int(i), float(lp)) for i, lp in zip(ids.tolist(), values.tolist(), strict=True)]
    return chosen, top
