"""The prompt tokens and output budget the policies see for requests bound for SGLang workers."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.router import Router
from gateway.sglang_routing import (
    DEFAULT_MAX_NEW_TOKENS,
    ROUTING_PAGE_TOKENS,
    dispatch_cost,
    max_new_tokens,
    prompt_ids,
    routing_request,
)
from gateway.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.mark.parametrize(("route", "body", "expected"), [
    ("generate", {"text": "abc"}, list(b"abc")),
    ("generate", {"text": ["abc", "xyz"]}, list(b"abc")),
    ("generate", {"input_ids": [5, 6, 7]}, [5, 6, 7]),
    ("generate", {"input_ids": [[5, 6], [7]]}, [5, 6]),
    ("completions", {"prompt": "hi"}, list(b"hi")),
    ("completions", {"prompt": [[1, 2], [3]]}, [1, 2]),
    ("completions", {"prompt": [9, 8]}, [9, 8]),
    ("completions", {}, []),
    ("generate", {"input_ids": [1, "x"]}, []),
    ("generate", {"input_ids": [1, 2**63]}, []),  # (the worker's to refuse; it would not hash for the index)
    ("completions", {"prompt": [-1, 2]}, []),
])
def test_prompt_ids_of_each_route_shape(route: str, body: dict[str, Any], expected: list[int]) -> None:
    assert prompt_ids(TOK, route, body) == expected


def test_chat_goes_through_the_chat_template() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert prompt_ids(TOK, "chat", {"messages": messages}) == TOK.apply_chat_template(messages)
    assert prompt_ids(TOK, "chat", {"messages": []}) == []


@pytest.mark.parametrize(("route", "body", "expected"), [
    ("generate", {"sampling_params": {"max_new_tokens": 7}}, 7),
    ("generate", {"sampling_params": None}, DEFAULT_MAX_NEW_TOKENS),
    ("chat", {"max_completion_tokens": 9, "max_tokens": 3}, 9),
    ("completions", {"max_tokens": 3}, 3),
    ("completions", {"max_tokens": -1}, DEFAULT_MAX_NEW_TOKENS),
    ("chat", {"max_tokens": True}, DEFAULT_MAX_NEW_TOKENS),
])
def test_max_new_tokens(route: str, body: dict[str, Any], expected: int) -> None:
    assert max_new_tokens(route, body) == expected


def test_an_unreadable_prompt_routes_without_tokens() -> None:
    router = Router.build("cache_aware", "cache_aware")
    bad = routing_request(router, TOK, "chat", {"messages": [{"role": "user", "content": 5}]})
    assert list(bad.input_ids) == [] and bad.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert list(routing_request(router, None, "generate", {"text": "abc"}).input_ids) == []
    assert list(routing_request(router, TOK, "generate", {"text": "abc"}).input_ids) == list(b"abc")


def test_token_ids_past_the_wire_format_route_by_load_alone() -> None:
    """cache_aware hashes the prompt's pages: an id past int64 raised there, a 500 from the relay."""
    from gateway.worker_state import WorkerState

    router = Router.build("cache_aware", "cache_aware")
    request = routing_request(router, TOK, "generate", {"input_ids": [2**63] * 40})
    views = [WorkerState(f"http://127.0.0.1:{p}", role, None) for p, role in ((1, "prefill"), (2, "decode"))]
    for view in views:
        view.page_size = 16  # (SGLang workers: ``ROUTING_PAGE_TOKENS``)
    pair = router.select([views[0]], [views[1]], request)
    assert pair.prefill is views[0] and pair.decode is views[1]


def test_a_dispatch_costs_its_uncached_prompt_and_its_pages() -> None:
    """What an attempt adds to its workers' load counts: the prefill's uncached prompt tokens (as far as
    the gateway routed this prefix there), the decode's pages; every item of a batch; without ids, the
    prompt guessed from the body's size."""
    from gateway.policies.contract import FakeWorker

    router = Router.build("cache_aware", "cache_aware")
    prefill = FakeWorker("http://p:1", "prefill", page_size=ROUTING_PAGE_TOKENS)
    request = routing_request(router, TOK, "generate", {"text": "a" * 100, "sampling_params": {"max_new_tokens": 28}})
    assert dispatch_cost(request, prefill, None, 999) == (100, 8)  # (100 + 28) / 16
    router.index.assume(prefill.url, request.page_hashes(ROUTING_PAGE_TOKENS))  # routed there a moment ago
    again = routing_request(router, TOK, "generate", {"text": "a" * 100, "sampling_params": {"max_new_tokens": 28}})
    assert again.num_cached_tokens(prefill) == 96 and dispatch_cost(again, prefill, 3, 999) == (3 * 4, 3 * 8)
    blind = routing_request(router, None, "generate", {"text": "a" * 100})
    assert dispatch_cost(blind, prefill, None, 400) == (100, -(-(100 + DEFAULT_MAX_NEW_TOKENS) // 16))
