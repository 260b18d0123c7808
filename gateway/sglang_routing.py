"""What the policies learn about a request bound for SGLang workers: its prompt's tokens, when the gateway
has a tokenizer (``--tokenizer``), and its output budget.

SGLang workers tokenize for themselves, so the body goes through untouched and nothing here can fail a
request: a body the tokenizer cannot read routes as if there were no tokenizer (by load alone). The
token ids only feed routing: ``cache_aware`` matches them against the prefixes the gateway itself sent
to each prefill (SGLang workers publish no KV events, so the index holds what ``Router.dispatched``
assumed, for ``--assume-ttl-s``), and the load-based policies size the prompt with them.

Lifecycle: ``routing_request(router, tokenizer, route, body)`` once per client request (not per retry),
on the event loop; it costs one tokenization when a tokenizer is set, nothing otherwise.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gateway.api_models import is_token_ids

if TYPE_CHECKING:
    from gateway.policies.base import RequestInfo, WorkerView
    from gateway.router import Router
    from gateway.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# SGLang workers do not tell their KV page size through this protocol; prefixes are matched (and their
# load reports counted) in pages of this many tokens.
ROUTING_PAGE_TOKENS = 16
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default for /generate when the body gives none
BYTES_PER_TOKEN = 4  # a prompt's tokens guessed from the request's size, without a tokenizer


def dispatch_cost(request: RequestInfo, prefill: WorkerView, num_items: int | None, body_bytes: int) -> tuple[int, int]:
    """What one attempt adds to its workers' load until it ends (counted on top of their last load poll,
    so that requests routed between two polls are not invisible): the prefill's uncached prompt tokens
    and the decode's KV pages, for every item of a batch. Without the prompt's ids (no ``--tokenizer``)
    the prompt is guessed from the body's size."""
    items = num_items or 1
    if request.input_ids:
        prompt = len(request.input_ids)
        uncached = prompt - (request.num_cached_tokens(prefill) if request.has_page_hashes else 0)
    else:
        prompt = uncached = body_bytes // BYTES_PER_TOKEN
    pages = -(-(prompt + request.max_new_tokens) // ROUTING_PAGE_TOKENS)
    return uncached * items, pages * items


def routing_request(router: Router, tokenizer: Tokenizer | None, route: str, body: dict[str, Any]) -> RequestInfo:
    """The policies' ``RequestInfo`` for one request: the first item's prompt ids (or none) and budget."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = prompt_ids(tokenizer, route, body)
        except Exception as exc:  # any unreadable prompt only loses prefix routing
            log.debug("no routing tokens for this %s request: %s: %s", route, type(exc).__name__, exc)
            ids = []
    return router.request(ids, max_new_tokens(route, body))


def prompt_ids(tokenizer: Tokenizer, route: str, body: dict[str, Any]) -> list[int]:
    """The token ids of the request's (first) prompt, as the worker would see them; [] if it has none."""
    if route == "chat":
        messages = body.get("messages")
        return tokenizer.apply_chat_template(messages) if isinstance(messages, list) and messages else []
    if route == "generate":
        prompt: Any = body.get("input_ids")
        if prompt is None:
            prompt = body.get("text")
    else:
        prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its items usually share a prefix, the first stands for them
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if is_token_ids(prompt):
        return prompt  # (ids past that are the worker's to refuse; here they would not even hash)
    return []


def max_new_tokens(route: str, body: dict[str, Any]) -> int:
    """The request's output budget as the worker reads it (its default when the body gives none)."""
    if route == "generate":
        params = body.get("sampling_params")
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    return value if type(value) is int and value >= 0 else DEFAULT_MAX_NEW_TOKENS
