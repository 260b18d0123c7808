"""Workers whose KV pools differ: a request goes only to workers whose whole pool can hold it (a decode:
prompt + max_new_tokens; a prefill: the prompt), whatever the policy would have picked; one that no worker
can hold is a 400 sent to no worker, and one that only an unavailable worker could hold a 503."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from test_hot_path import _connected_workers, _sent

from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.errors import BadRequest, NoWorkers
from gateway.policies.simple import RoundRobinPolicy
from gateway.router import Router
from workers.protocol import SamplingParams, Submit


def _resize(worker: Any, num_pages: int) -> None:
    """The worker (re)connected with a pool of ``num_pages`` pages of 4 tokens."""
    worker.info = msgspec.structs.replace(worker.info, num_pages=num_pages)
    worker.state.connected(worker.info)


def _fleet(prefill_pages: list[int], decode_pages: list[int], *, combined: bool = False,
           ) -> tuple[Dispatcher, list[Any], list[Any], list[Any]]:
    loop = asyncio.get_running_loop()
    prefills, p_transports = _connected_workers(loop, "prefill", len(prefill_pages)) if not combined else ([], [])
    decodes, d_transports = _connected_workers(loop, "both" if combined else "decode", len(decode_pages))
    for worker, pages in zip([*prefills, *decodes], [*prefill_pages, *decode_pages], strict=True):
        _resize(worker, pages)
    policy = RoundRobinPolicy()
    dispatcher = Dispatcher(prefills, decodes, Router(policy, policy), DispatchConfig(max_retries=0),
                            combined=combined)
    return dispatcher, prefills, decodes, [*p_transports, *d_transports]


def _picks(dispatcher: Dispatcher, prompt: int, max_new: int, times: int = 6) -> list[tuple[Any, Any]]:
    request = dispatcher.router.request(list(range(prompt)), max_new)
    return [dispatcher._select(request, set())[1:] for _ in range(times)]


def test_a_request_goes_only_to_the_workers_that_can_hold_it() -> None:
    async def main() -> None:
        # decode 0 holds 256 tokens, decode 1 4096; prefill 0 holds 64, prefill 1 4096
        dispatcher, prefills, decodes, _ = _fleet([16, 1024], [64, 1024])
        small = _picks(dispatcher, 10, 10)
        assert {d for _, d in small} == set(decodes) and {p for p, _ in small} == set(prefills)  # round robin
        assert {d for _, d in _picks(dispatcher, 100, 200)} == {decodes[1]}  # 300 tokens: only the big decode
        assert {d for _, d in _picks(dispatcher, 100, 156)} == set(decodes)  # 256: both (a pool exactly full)
        assert {p for p, _ in _picks(dispatcher, 65, 1)} == {prefills[1]}  # a 65-token prompt: the big prefill
        assert {p for p, _ in _picks(dispatcher, 64, 1)} == set(prefills)

    asyncio.run(main())


@pytest.mark.parametrize("combined", [False, True])
def test_a_request_no_worker_can_hold_is_a_400_sent_to_no_worker(combined: bool) -> None:
    async def main() -> None:
        dispatcher, prefills, decodes, transports = _fleet([] if combined else [1024], [64, 100], combined=combined)
        with pytest.raises(BadRequest) as err:
            async with asyncio.timeout(10):  # (sent to a worker, it would wait for an answer that never comes)
                async for _ in dispatcher.generate(list(range(300)), SamplingParams(max_new_tokens=120)):
                    pass
        side = "combined" if combined else "decode"
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
        assert err.value.param == "max_new_tokens"
        assert f"needs 420 tokens of KV cache (the prompt and the most tokens to generate); the largest {side} " \
            "worker's pool holds 400" in err.value.message
        assert not any(_sent(t, Submit) for t in transports)
        assert not any(w.state.num_active for w in (*prefills, *decodes))

    asyncio.run(main())


def test_a_prompt_no_prefill_can_hold_is_a_400_naming_the_prompt() -> None:
    async def main() -> None:
        dispatcher, _, _, transports = _fleet([16, 20], [1024])
        with pytest.raises(BadRequest) as err:
            async with asyncio.timeout(10):
                await dispatcher.complete(list(range(81)), SamplingParams(max_new_tokens=1), _Nothing())
        assert err.value.param is None and "needs 81 tokens of KV cache (the prompt); the largest prefill " \
            "worker's pool holds 80" in err.value.message
        assert not any(_sent(t, Submit) for t in transports)

    asyncio.run(main())


class _Nothing:
    finish_reason = None

    def accept(self, output: Any) -> None:
        raise AssertionError("nothing is sent, so nothing comes back")


def test_a_prompt_longer_than_every_decode_pool_is_not_blamed_on_max_tokens() -> None:
    async def main() -> None:
        dispatcher, _, _, _ = _fleet([1024], [64, 100])
        with pytest.raises(BadRequest) as err:
            _picks(dispatcher, 500, 10, times=1)
        assert err.value.param is None
        assert "needs 500 tokens of KV cache (the prompt); the largest decode worker's pool holds 400" \
            in err.value.message

    asyncio.run(main())


def test_a_request_only_an_unavailable_worker_could_hold_is_a_503() -> None:
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [64, 1024])
        decodes[1].is_draining = True
        with pytest.raises(NoWorkers) as err:
            _picks(dispatcher, 100, 200, times=1)
        assert err.value.status == 503
        assert "no healthy decode worker has a KV pool and context that hold" in err.value.message
        assert {d for _, d in _picks(dispatcher, 10, 10)} == {decodes[0]}  # a small one is served meanwhile

    asyncio.run(main())


def test_a_worker_that_reconnects_with_another_pool_is_judged_by_its_new_one() -> None:
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [1024, 1024])
        assert {d for _, d in _picks(dispatcher, 100, 200)} == set(decodes)
        _resize(decodes[0], 64)  # restarted with a smaller pool
        assert {d for _, d in _picks(dispatcher, 100, 200)} == {decodes[1]}
        _resize(decodes[0], 2048)
        assert {d for _, d in _picks(dispatcher, 100, 200)} == set(decodes)

    asyncio.run(main())


def test_the_default_budget_is_cut_to_the_largest_decode_pool() -> None:
    """``decode_capacity`` (what a budget the client did not set is cut to) is the largest connected decode's
    pool, and follows a decode that reconnects with another pool."""
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [64, 256])
        assert dispatcher.decode_capacity() == 1024  # 256 pages of 4 tokens
        _resize(decodes[1], 32)
        assert dispatcher.decode_capacity() == 256  # the other one's 64 pages
        _resize(decodes[0], 1000)
        assert dispatcher.decode_capacity() == 4000
        _resize(decodes[0], 2048)  # (8192 tokens of KV, past the model's context of 4096: no request is longer)
        assert dispatcher.decode_capacity() == decodes[0].info.max_context == 4096

    asyncio.run(main())


def test_a_request_longer_than_a_workers_context_goes_to_one_whose_context_holds_it() -> None:
    """A worker's context bounds what it takes as its pool does: one with a shorter context (back after the gateway
    prepared a request by the longer contexts of the workers connected meanwhile) is not given a request past it,
    which it would refuse with a 400."""
    async def main() -> None:
        dispatcher, prefills, decodes, _ = _fleet([1024, 1024], [1024, 1024])
        for worker in (prefills[0], decodes[0]):  # (a 4096-token pool each, the model's context 512)
            worker.info = msgspec.structs.replace(worker.info, max_context=512)
            worker.state.connected(worker.info)
        assert {d for _, d in _picks(dispatcher, 10, 10)} == set(decodes)
        assert {d for _, d in _picks(dispatcher, 100, 500)} == {decodes[1]}
        assert {p for p, _ in _picks(dispatcher, 600, 1)} == {prefills[1]}
        prefills[1].info = msgspec.structs.replace(prefills[1].info, max_context=512)
        prefills[1].state.connected(prefills[1].info)
        with pytest.raises(BadRequest) as err:  # (every prefill's pool holds the prompt; no context holds it)
            _picks(dispatcher, 600, 1)
        assert err.value.code == "context_length_exceeded" and "the longest: 512" in err.value.message

    asyncio.run(main())


def test_the_longest_prompt_a_prefill_takes_leaves_room_in_its_context_for_a_token() -> None:
    """``prompt_capacity`` (what ``/v1/models``' ``max_model_len`` is cut to): a prefill whose pool holds more than
    its context does takes a prompt of its context less one token (the one to generate), not its pool's."""
    async def main() -> None:
        dispatcher, prefills, _, _ = _fleet([1024, 64], [1024])
        assert dispatcher.prompt_capacity() == 4095  # (the large pool's 4096 tokens, its context 4096)
        prefills[0].info = msgspec.structs.replace(prefills[0].info, max_context=512)
        prefills[0].state.connected(prefills[0].info)
        assert dispatcher.prompt_capacity() == 511  # (the other one's pool holds 256)

    asyncio.run(main())
