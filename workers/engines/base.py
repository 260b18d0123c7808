"""The engine seam: what the scheduler asks of a model implementation.

Lifecycle:
1. The worker builds an engine from its name (entry point group ``pd_gateway.engines``) and an
   ``EngineOptions``; construction loads weights and may take seconds.
2. The worker reads ``engine.info`` to size the ``KVPool`` and calls ``bind(pool)`` once.
3. The scheduler thread calls ``forward(batch)`` once per step; it blocks for the step's compute.
   Each ``SeqInput`` names a sequence's page table, how many of its positions already hold KV,
   the new token ids whose KV this step writes, and whether to sample one token after them.
4. ``close()`` at shutdown.

Engines never allocate pages and never talk to the network: the scheduler owns both.
"""

from __future__ import annotations

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
    all_token_ids: list[int] | None = None  # prompt + outputs so far (penalties, sim verification)


@dataclass
class SeqOutput:
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float] | None = None


class Engine(ABC):
    """A model behind the scheduler. Subclasses set ``info`` in ``__init__``."""

    name: str = "engine"
    info: ModelInfo

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
