"""The engine seam: what the scheduler asks of a model implementation.

Lifecycle:
1. The worker builds an engine from its name (entry point group ``pd_gateway.engines``) and an
   ``EngineOptions``; construction loads weights and may take seconds.
2. The worker reads ``engine.info`` to size the ``KVPool`` and calls ``bind(pool)`` once.
3. The scheduler thread calls ``forward(batch)`` once per step; it blocks for the step's compute: when
   it returns, the step's KV is in the pool's memory (a GPU engine waits for its kernels), because the
   transfer layer may read those pages at once.
   Each ``SeqInput`` names a sequence's page table, how many of its positions already hold KV,
   the new token ids whose KV this step writes, and whether to sample one token after them.
4. ``close()`` at shutdown.

Engines never allocate pages and never talk to the network: the scheduler owns both.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from workers.kv_pool import KVPool
from workers.protocol import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class ModelInfo:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    tokenizer: str  # "byte" or a directory holding tokenizer.json (+ chat template)


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings from the worker's command line; engines ignore what they do not use."""

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"
    num_threads: int = 1
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class SeqInput:
    rid: int
    page_ids: list[int]
    num_cached: int
    token_ids: list[int]
    sample: bool
    params: SamplingParams
    num_generated: int = 0  # index of the output token this step samples (seeded sampling)
    # Prompt + outputs so far: on prefill chunks, and on decode steps of requests that ``needs_history``.
    all_token_ids: list[int] | None = None


@dataclass
class SeqOutput:
    token_id: int | None = None  # None (a sampled row): this request fails, the batch goes on
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[TokenLogprob]] | None = None  # (with ``params.top_logprobs``)
    error: str | None = None  # (no token) why, when it is the request's own doing (its grammar): a bad_request


# Optional sampling fields of ``SamplingParams`` and their neutral values. An engine implements those
# its ``supported_sampling`` names; a request that sets another to a non-neutral value is refused
# (``check_sampling``), never served as if it had not asked.
OPTIONAL_SAMPLING: dict[str, object] = {
    "logit_bias": {},
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's, for presence_penalty and frequency_penalty


def requested_sampling(params: SamplingParams) -> list[str]:
    """The optional sampling fields ``params`` sets to a non-neutral value."""
    return [name for name, neutral in OPTIONAL_SAMPLING.items() if getattr(params, name) != neutral]


def needs_history(params: SamplingParams) -> bool:
    """Whether sampling depends on the tokens before (penalties): the scheduler then passes
    ``SeqInput.all_token_ids`` on every step."""
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def banned_by_min_tokens(params: SamplingParams, num_outputs: int, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Token ids ``min_new_tokens`` forbids after ``num_outputs`` outputs (including ``output_offset``)."""
    if num_outputs >= params.min_new_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned += eos_token_ids
    return banned


def check_sampling(params: SamplingParams, engine: Engine) -> str | None:
    """Why ``engine`` cannot serve these optional sampling fields (a field named first), or None."""
    for name in requested_sampling(params):
        if name not in engine.supported_sampling:
            return f"{name} is not supported by the {engine.name} engine"
    vocab = engine.info.vocab_size
    for token in params.stop_token_ids:  # (min_new_tokens bans them by index: one outside would fail the batch)
        if not 0 <= token < vocab:
            return f"stop_token_ids: token id {token} is outside the vocabulary [0, {vocab})"
    low, high = LOGIT_BIAS_RANGE
    for token, bias in params.logit_bias.items():
        if not 0 <= token < vocab:
            return f"logit_bias: token id {token} is outside the vocabulary [0, {vocab})"
        if not low <= bias <= high:
            return f"logit_bias: the bias of token {token} must be in [{low:g}, {high:g}], got {bias}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
            return f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}"
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        return f"repetition_penalty must be a positive number, got {params.repetition_penalty}"
    if params.min_new_tokens < 0:
        return f"min_new_tokens must be >= 0, got {params.min_new_tokens}"
    if params.prompt_logprobs_start < 0:
        return f"prompt_logprobs_start must be >= 0, got {params.prompt_logprobs_start}"
    # the fields every request carries: a value outside these cannot be sampled from (NaN probabilities)
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        return f"temperature must be a number >= 0, got {params.temperature}"
    if not 0 < params.top_p <= 1:  # (False for NaN)
        return f"top_p must be in (0, 1], got {params.top_p}"
    if not 0 <= params.min_p <= 1:
        return f"min_p must be in [0, 1], got {params.min_p}"
    if params.top_k < -1:
        return f"top_k must be -1 (off), 0 (off) or positive, got {params.top_k}"
    return None


class Engine(ABC):
    """A model behind the scheduler. Subclasses set ``info`` in ``__init__``.

    ``supported_sampling``: the ``OPTIONAL_SAMPLING`` fields the engine implements; the scheduler
    refuses a request that sets any other (a plugin that knows none of them refuses them all).
    """

    name: str = "engine"
    info: ModelInfo
    supported_sampling: frozenset[str] = frozenset()

    @abstractmethod
    def bind(self, pool: KVPool) -> None:
        """Attach the worker's KV pool (same memory the transfer layer registered)."""

    @abstractmethod
    def forward(self, batch: list[SeqInput]) -> list[SeqOutput]:
        """Write KV for every sequence's new tokens; sample where asked. One output per input."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


@runtime_checkable
class KVChecker(Protocol):
    """Optional engine ability: recompute what a prompt's KV must be and check the pool against it.

    The scheduler checks for it once at start-up (``isinstance``). The decode side calls ``verify``
    on every imported prompt (reported as ``kv_verified``), both roles call ``digest`` for
    ``/debug/rooms``. Either may answer None: "not checked" (e.g. ``sim`` with ``verify_kv=0``).
    """

    def verify(self, page_ids: list[int], token_ids: list[int]) -> bool | None:
        """Whether the pool holds exactly the KV ``token_ids`` produce at positions 0.."""
        ...

    def digest(self, page_ids: list[int], num_tokens: int) -> int | None:
        """A checksum of the KV of positions [0, num_tokens) as held in the pool."""
        ...


@runtime_checkable
class SequenceState(Protocol):
    """Optional engine ability: state kept per sequence between steps (e.g. penalty counts).

    The scheduler checks for it once at start-up (``isinstance``) and calls ``forget`` once for every
    sequence it releases (finished, failed, aborted), from its own thread.
    """

    def forget(self, seq_id: int) -> None:
        """Drop what is kept for ``seq_id`` (``SeqInput.rid``); unknown ids are ignored."""
        ...
