"""Pair-selection policies: built-ins and the plugin interface they share with third parties.

Built-ins (each its own module): ``random``, ``round_robin`` (load-blind baselines),
``power_of_two``, ``cache_aware``, ``ratio_aware``. See ``docs/policies.md`` for plugin authors.
"""

from __future__ import annotations

from gateway.policies.base import (
    OUTCOMES,
    Pair,
    Policy,
    PolicyHooks,
    PolicyStats,
    PrefixLookup,
    RequestInfo,
    WorkerView,
)
from gateway.policies.loader import GROUP, PolicyError, create_policy, load_policy_class, parse_option_args
from gateway.policies.simple import RandomPolicy, RoundRobinPolicy

__all__ = [
    "GROUP",
    "OUTCOMES",
    "Pair",
    "Policy",
    "PolicyError",
    "PolicyHooks",
    "PolicyStats",
    "PrefixLookup",
    "RandomPolicy",
    "RequestInfo",
    "RoundRobinPolicy",
    "WorkerView",
    "create_policy",
    "load_policy_class",
    "parse_option_args",
]
