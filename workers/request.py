"""One request's state inside a worker, from admission to release."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.protocol import BootstrapTarget, SamplingParams, StepOutput, TokenLogprob

if TYPE_CHECKING:
    from workers.stop_strings import StopWatch

_SEQ_IDS = itertools.count(1)


@dataclass(eq=False)
class Req:
    key: tuple[int, int]  # (connection id, rid): rids are unique per gateway connection
    input_ids: list[int]
    params: SamplingParams
    deadline: float
    bootstrap: BootstrapTarget | None = None
    request_id: str = ""  # the client's x-request-id (for log lines)
    stage: str = "new"
    pages: list[int] = field(default_factory=list)
    aux_slot: int | None = None
    num_computed: int = 0  # positions whose KV is in ``pages``
    prefill_len: int = 0  # positions to compute before decoding (the prompt; more after a preemption)
    is_recompute: bool = False  # preempted: recompute KV of prompt + outputs, then continue decoding
    requeued: bool = False  # sent back to waiting mid-prefill (combined role, out of pages): prefills again
    # chained hashes of the full pages of ``all_ids[:prefill_len]`` (prefix-cache workers; ``Scheduler._hashes``)
    page_hashes: list[bytes] | None = None
    awaited_prefix: bool = False  # waited for another request's prefix (counted once)
    num_indexed_pages: int = 0  # its leading pages in ``Scheduler._queued_pages`` (until its prefill ends)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported in usage)
    num_cached_estimate: int = 0  # at admission: prompt tokens the prefix cache held (for load reports)
    num_sent_pages: int = 0  # prefill: pages already handed to the KV sender
    output_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # (they go out with the request's first output)
    kv_sender: Any = None
    kv_receiver: Any = None
    kv_verified: bool | None = None
    done: bool = False
    gather_s: float = 0.0  # (``Submit.gather_s``) outputs after the first may be held this long
    held: StepOutput | None = None  # the outputs held so far, as one ``StepOutput`` (sent with the next one due)
    held_since: float = 0.0  # when the first of them was held
    first_output: Any = None  # decode: the first token's ``SeqOutput`` while the batch has no room (stage imported)
    stop_watch: StopWatch | None = None  # the output text, when the params have stop strings this worker checks
    # (``GrammarWait.hold``) the engine's compile of its grammar, kept while the request lives: an engine's
    # cache may evict it meanwhile (many distinct grammars queued), but finds it again (no recompile)
    grammar_compile: Any = None
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))  # unique in this worker (engine key)

    @property
    def rid(self) -> int:
        return self.key[1]

    @property
    def room(self) -> int | None:
        return self.bootstrap.room if self.bootstrap is not None else None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def __post_init__(self) -> None:
        self.prefill_len = self.prefill_len or len(self.input_ids)

    def move(self, stage: str) -> None:
        self.stage = stage


def live(reqs: Iterable[Req], stage: str | None = None) -> list[Req]:
    """The requests of ``reqs`` not ended (and in ``stage``, when given: a batch list keeps a request that
    moved on, e.g. a prefill's now in flight, until the scheduler's next step prunes it)."""
    return [r for r in list(reqs) if not r.done and (stage is None or r.stage == stage)]
