"""PD dispatch: pick a pair, give it a fresh bootstrap room, drive both sides, stream decode tokens.

Lifecycle of one request (``Dispatcher.generate``, an async generator):
1. Select a (prefill, decode) pair among healthy workers with the policy (sync, no I/O).
2. Draw a fresh ``bootstrap_room`` (random 63-bit) and submit to the decode and the prefill at
   once: awaiting one before the other would deadlock the KV handshake.
3. Relay the decode's ``StepOutput`` events. The prefill's only event is "transferred" (or an
   error). Failure coupling: a prefill error aborts the decode, a decode error aborts the prefill.
4. Before the first token, a retryable failure (worker gone, transfer failed, overloaded) retries
   with a new pair and a new room, at most ``max_retries`` times; after it, the error is final.
5. Deadlines: ``first_token_timeout_s`` until the first token, then ``stream_idle_timeout_s``
   between events. Whatever ends the generator (finish, error, timeout, client gone), open
   requests are aborted on both workers.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, BadGateway, NoWorkers, UpstreamTimeout, from_worker_error
from gateway.policies import Policy, RequestInfo
from gateway.worker_client import Event, WorkerClient, WorkerGone
from workers.protocol import BootstrapTarget, Error, SamplingParams, StepOutput, Submit

RETRYABLE_CODES = frozenset({"transfer_failed", "overloaded", "shutting_down"})


@dataclass(frozen=True)
class DispatchConfig:
    first_token_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0
    max_retries: int = 2


class Dispatcher:
    def __init__(self, prefills: Sequence[WorkerClient], decodes: Sequence[WorkerClient], policy: Policy,
                 config: DispatchConfig | None = None) -> None:
        if not decodes:
            raise ValueError("the gateway needs at least one decode (or combined) worker")
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.policy = policy
        self.config = config or DispatchConfig()
        self.num_retries = 0

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefills)

    def healthy_workers(self) -> tuple[list[WorkerClient], list[WorkerClient]]:
        return [w for w in self.prefills if w.healthy], [w for w in self.decodes if w.healthy]

    def _select(self, request: RequestInfo) -> tuple[WorkerClient | None, WorkerClient]:
        prefills, decodes = self.healthy_workers()
        if not decodes or (self.is_disaggregated and not prefills):
            missing = "decode" if not decodes else "prefill"
            raise NoWorkers(f"no healthy {missing} worker", retry_after_s=1.0)
        pair = self.policy.select(prefills, decodes, request)
        return pair.prefill, pair.decode  # type: ignore[return-value]

    async def generate(self, input_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        attempt = 0
        while True:
            started = False
            try:
                async for item in self._attempt(input_ids, params):
                    started = True
                    yield item
                return
            except _Retryable as exc:
                if started or attempt >= self.config.max_retries:
                    raise exc.error from None
                attempt += 1
                self.num_retries += 1

    async def _attempt(self, input_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        prefill, decode = self._select(RequestInfo(input_ids, params.max_new_tokens))
        sink: asyncio.Queue[tuple[Any, Event]] = asyncio.Queue()
        timeout_s = self.config.request_timeout_s
        open_rids: dict[str, tuple[WorkerClient, int]] = {}
        finished = False
        try:
            target = None
            if prefill is not None:
                info = prefill.info
                assert info is not None
                if info.bootstrap_host is None:
                    raise BadGateway(f"prefill worker {prefill.url} reported no bootstrap address")
                target = BootstrapTarget(info.bootstrap_host, info.bootstrap_port, secrets.randbits(63),
                                         info.instance_id)
            try:
                rid = decode.submit(Submit(0, input_ids, params, target, timeout_s), sink, "decode")
                open_rids["decode"] = (decode, rid)
                if prefill is not None:
                    rid = prefill.submit(Submit(0, input_ids, params, target, timeout_s), sink, "prefill")
                    open_rids["prefill"] = (prefill, rid)
            except ConnectionError as exc:
                raise _Retryable(BadGateway(str(exc))) from None
            got_token = False
            # Prompt logprobs come from the prefill; its report may trail the decode's last token.
            want_prompt = params.prompt_logprobs and prefill is not None
            prompt_logprobs: list[float] | None = None
            held_final: StepOutput | None = None
            while True:
                wait_s = self.config.stream_idle_timeout_s if got_token else self.config.first_token_timeout_s
                try:
                    side, event = await asyncio.wait_for(sink.get(), wait_s)
                except TimeoutError:
                    stage = "between tokens" if got_token else "before the first token"
                    raise UpstreamTimeout(f"no progress from the workers for {wait_s:g}s {stage}") from None
                if isinstance(event, StepOutput):
                    if side == "prefill":
                        open_rids.pop("prefill", None)  # KV handed over; the decode carries on
                        prompt_logprobs = event.prompt_logprobs
                        if held_final is not None:
                            held_final.prompt_logprobs = prompt_logprobs
                            yield held_final
                            return
                        continue
                    got_token = got_token or bool(event.token_ids)
                    if event.finish_reason is not None:
                        open_rids.pop("decode", None)
                        finished = True
                        if want_prompt:
                            if "prefill" in open_rids:
                                held_final = event
                                continue
                            event.prompt_logprobs = prompt_logprobs
                    yield event
                    if finished:
                        return
                else:
                    open_rids.pop(side, None)
                    if side == "prefill" and (got_token or held_final is not None):
                        # The decode already has its KV: a late prefill failure (e.g. restarting) does
                        # not concern it; only its prompt logprobs are lost.
                        if held_final is not None:
                            yield held_final
                            return
                        continue
                    raise _as_error(event, side)
        finally:
            if not finished:  # error, timeout or the client went away: free both sides now
                for worker, rid in open_rids.values():
                    worker.abort(rid)


class _Retryable(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def _as_error(event: Event, side: str) -> Exception:
    if isinstance(event, WorkerGone):
        return _Retryable(BadGateway(event.message, code="worker_gone"))
    assert isinstance(event, Error)
    error = from_worker_error(event.code, event.message, side)
    if event.code in RETRYABLE_CODES:
        return _Retryable(error)
    return error
