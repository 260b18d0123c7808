"""Pair selection for the dispatcher: the prefill and decode policies, the prefix index, the hooks.

Lifecycle (event loop only):
1. ``Router.build(prefill_name, decode_name, options)`` at start-up: one policy instance when both
   sides name the same policy (so it can choose the pair jointly), else one per side; options are
   validated there (unprefixed ones go to every policy that declares them; ``prefill.K`` /
   ``decode.K`` to one side; an option nobody declares is an error).
2. Workers joining and leaving: ``worker_added`` / ``worker_removed`` (index cleared, hooks).
3. Per attempt: ``request(input_ids, max_new)`` -> ``RequestInfo`` wired to the index;
   ``select(prefills, decodes, request)``; ``dispatched(pair, request)`` (if the policy looked at
   the cache, the prompt's pages are assumed cached on the chosen prefill for a moment);
   ``finished(pair, request, outcome)``.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from gateway.errors import APIError
from gateway.policies.base import OUTCOMES, Pair, Policy, PolicyStats, RequestInfo, WorkerView
from gateway.policies.loader import HOOK_NAMES, PolicyError, create_policy, load_policy_class, option_names
from gateway.prefix_index import PrefixIndex
from workers.protocol import KVEvents

log = logging.getLogger(__name__)
T = TypeVar("T")
HOOK_ERROR_LOG_INTERVAL_S = 10.0  # a policy failing on every request is logged this often, with its count


class Router:
    def __init__(self, prefill_policy: Policy, decode_policy: Policy, index: PrefixIndex | None = None) -> None:
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.index = index or PrefixIndex()
        self.is_joint = prefill_policy is decode_policy
        policies = [prefill_policy] if self.is_joint else [prefill_policy, decode_policy]
        # Optional abilities, resolved once: the bound hooks each policy defines.
        self._hooks: dict[str, list[Callable[..., None]]] = {
            hook: [fn for p in policies if callable(fn := getattr(p, hook, None))] for hook in HOOK_NAMES
        }
        # (the two per-attempt hooks' lists, the same objects as in ``_hooks``, read without the dict; the
        # dispatcher calls ``finished`` only when ``finish_hooks`` has any, and ``dispatched`` only when
        # ``dispatch_hooks`` has any or a policy looked at the cache: else they have nothing to do)
        self.dispatch_hooks, self.finish_hooks = self._hooks["on_dispatch"], self._hooks["on_finish"]
        self._stats = [p for p in policies if isinstance(p, PolicyStats)]
        self.policies = policies
        self.num_hook_errors = 0  # selects, hooks and stats() of the policies that raised (logged at most so often)
        self._last_hook_log = -math.inf
        self._unlogged = 0

    @classmethod
    def build(cls, prefill_name: str, decode_name: str, options: Mapping[str, Mapping[str, str]] | None = None,
              *, assume_ttl_s: float | None = None) -> Router:
        options = options or {}
        shared = dict(options.get("", {}))
        sides = {"prefill": prefill_name, "decode": decode_name}
        accepted = {side: option_names(load_policy_class(name)) for side, name in sides.items()}
        unknown = [k for k in shared if not any(k in names for names in accepted.values())]
        for side in sides:
            unknown += [f"{side}.{k}" for k in options.get(side, {}) if k not in accepted[side]]
        if unknown:
            names = ", ".join(sorted(set(sides.values())))
            raise PolicyError(f"unknown policy option(s) {', '.join(unknown)} for policy {names}")
        # A policy may say which of its options matter when it only picks the decode (``decode_options``): one of
        # the others set for that side alone would be taken and change nothing.
        decode_options = getattr(load_policy_class(decode_name), "decode_options", None)
        idle = [f"decode.{k}" for k in options.get("decode", {})
                if decode_options is not None and k not in decode_options]
        # (and an unprefixed one that only the decode side takes, there to change nothing as well)
        idle += [k for k in shared if decode_options is not None and k not in decode_options
                 and k not in accepted["prefill"]]
        if idle:
            raise PolicyError(f"policy option(s) {', '.join(idle)} change nothing: policy {decode_name} picks a decode "
                              "without them (they are its prefill side's)")

        def side_options(side: str) -> dict[str, str]:
            mine = {k: v for k, v in shared.items() if k in accepted[side]}
            mine.update(options.get(side, {}))
            return mine

        prefill = create_policy(prefill_name, side_options("prefill"))
        if prefill_name == decode_name and side_options("prefill") == side_options("decode"):
            decode = prefill
        else:
            decode = create_policy(decode_name, side_options("decode"))
        index = PrefixIndex() if assume_ttl_s is None else PrefixIndex(assume_ttl_s)
        return cls(prefill, decode, index)

    @property
    def name(self) -> str:
        if self.is_joint:
            return self.prefill_policy.name
        return f"{self.prefill_policy.name}+{self.decode_policy.name}"

    # -- per request ------------------------------------------------------------------------------
    def request(self, input_ids: Sequence[int], max_new_tokens: int) -> RequestInfo:
        return RequestInfo(input_ids, max_new_tokens, self.index)

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        if self.is_joint:
            return self.prefill_policy.select(prefills, decodes, request)
        prefill = self.prefill_policy.select(prefills, decodes, request).prefill if prefills else None
        # The decode policy sees a combined-mode call: it only picks the decode.
        return Pair(prefill, self.decode_policy.select((), decodes, request).decode)

    def pick(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        """``select``, with a policy's failure (an exception, or not a ``Pair``) as the gateway's 500 naming the
        policy, sent to no worker. That the pair's workers are among those given is ``client_of``'s check."""
        try:  # (tuples: ``client_of`` checks the pair against the lists as given, which a policy cannot change)
            if self.is_joint:  # (``select``'s joint case, without its call)
                pair = self.prefill_policy.select(tuple(prefills), tuple(decodes), request)
            else:
                pair = self.select(tuple(prefills), tuple(decodes), request)
        except APIError:
            raise
        except Exception as exc:
            self._hook_failed(f"routing policy {self.name}'s select", outcome="the request's answer is a 500")
            raise APIError(f"routing policy {self.name} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(pair, Pair):
            raise APIError(f"routing policy {self.name} returned {pair!r}, not a Pair")
        return pair

    def client_of(self, view: object, given: Sequence[object], kind: type[T]) -> T:
        """``view``'s worker (its ``client``, a ``kind``), when ``view`` is one of the views the policy was
        ``given`` (healthy, not draining, not avoided: one it remembers from an earlier call may be none of
        these now); else the 500 naming the policy."""
        client = getattr(view, "client", None)
        if not isinstance(client, kind) or view not in given:
            raise APIError(f"routing policy {self.name} returned {view!r}, which is not one of the workers it was "
                           "given")
        return client

    def dispatched(self, pair: Pair, request: RequestInfo) -> None:
        if request.has_page_hashes:  # a policy looked at the cache
            self._assume_routed(pair, request)
        if hooks := self.dispatch_hooks:
            self._call_hooks(hooks, pair, request)

    def _assume_routed(self, pair: Pair, request: RequestInfo) -> None:
        target = pair.prefill if pair.prefill is not None else pair.decode
        if target.page_size > 0:
            # The pages its events do not show it holding: assumed from now on, also those assumed by an
            # earlier routing (renewed: a prefix kept busy is not re-homed when the first assumption ends).
            hashes = request.page_hashes(target.page_size)
            reported = self.index.num_reported(target.url, hashes)
            if reported < len(hashes):
                self.index.assume(target.url, hashes[reported:])

    def finished(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        if hooks := self.finish_hooks:
            self._call_hooks(hooks, pair, request, outcome)

    # -- membership and events --------------------------------------------------------------------
    def worker_added(self, worker: WorkerView) -> None:
        self._call_hooks(self._hooks["on_worker_added"], worker)

    def worker_removed(self, worker: WorkerView, *, drop_index: bool = True) -> None:
        """``worker`` went down; ``drop_index``: what the prefix index knows of its URL goes too (not when
        that URL is another connection's already)."""
        if drop_index:
            self.index.drop_worker(worker.url)
        self._call_hooks(self._hooks["on_worker_removed"], worker)

    def _call_hooks(self, hooks: list[Callable[..., None]], *args: Any) -> None:
        """A policy's hook that raises is a bug of the policy's: logged and counted, never the request's
        failure (it runs after the workers have answered, or in a worker connection's bookkeeping)."""
        for fn in hooks:
            try:
                result = fn(*args)
            except Exception:
                self._hook_failed(f"{getattr(fn, '__qualname__', fn)} (a policy's hook)")
                continue
            if inspect.isawaitable(result):  # (an ``async def`` hook: it would never run)
                if inspect.iscoroutine(result):
                    result.close()
                self._hook_failed(f"{getattr(fn, '__qualname__', fn)} (a policy's hook) returned an awaitable, which "
                                  "nothing awaits (hooks are called synchronously)", raised=False)

    def worker_forgotten(self, url: str) -> None:
        """``url`` left the fleet for good (removed and drained): the prefix index frees its place."""
        self.index.forget_worker(url)

    def kv_events(self, worker: WorkerView, events: KVEvents) -> None:
        self.index.apply(worker.url, events)

    def stats(self) -> dict[str, float]:
        """Every policy's figures as ``name.key`` (``prefill.name.key``, ``decode.name.key`` for the two
        instances of a split); a policy whose ``stats()`` raises or gives a non-number is left out."""
        out: dict[str, float] = {}
        for policy in self._stats:
            prefix = policy.name if self.is_joint else \
                f"{'prefill' if policy is self.prefill_policy else 'decode'}.{policy.name}"
            try:
                figures = {f"{prefix}.{key}": float(value) for key, value in policy.stats().items()}
            except Exception:
                self._hook_failed(f"stats() of policy {policy.name!r}")
                continue
            out.update((k, v) for k, v in figures.items() if math.isfinite(v))
        return out

    def _hook_failed(self, what: str, *, raised: bool = True, outcome: str = "ignored") -> None:
        self.num_hook_errors += 1
        now = time.monotonic()
        if now - self._last_hook_log < HOOK_ERROR_LOG_INTERVAL_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more policy errors since the last logged)" if self._unlogged else ""
        self._last_hook_log, self._unlogged = now, 0
        if raised:
            log.exception("%s raised; %s%s", what, outcome, more)
        else:
            log.error("%s; %s%s", what, outcome, more)

