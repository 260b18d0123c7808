"""The routing-policy seam shared by built-in policies and third-party plugins.

A policy is a small class found by entry point (group ``pd_gateway.policies``) or ``module:attr``
and selected by name on the gateway's command line. Contract:
- ``select(prefills, decodes, request)`` is synchronous, does no I/O, reads only the snapshot it
  is given, costs O(workers), and returns one prefill (None when the gateway runs combined
  workers) and one decode candidate from the given lists (which contain healthy workers only and
  are never both empty).
- ``on_finish(pair, request)`` is an optional hook for policies that keep their own ledgers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class WorkerView(Protocol):
    """What a policy may read about a worker (a snapshot; no I/O)."""

    url: str
    role: str
    num_active: int


@dataclass(frozen=True)
class RequestInfo:
    input_ids: Sequence[int]
    max_new_tokens: int


@dataclass(frozen=True)
class Pair:
    prefill: WorkerView | None
    decode: WorkerView


class Policy(Protocol):
    name: str

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        ...
