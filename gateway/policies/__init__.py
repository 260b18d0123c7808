"""Pair-selection policies: built-ins and the plugin interface they share with third parties."""

from __future__ import annotations

from gateway.policies.base import Pair, Policy, RequestInfo, WorkerView
from gateway.policies.simple import RandomPolicy, RoundRobinPolicy
from workers.plugins import available, load_plugin

__all__ = ["Pair", "Policy", "RandomPolicy", "RequestInfo", "RoundRobinPolicy", "WorkerView", "create_policy"]

GROUP = "pd_gateway.policies"


def create_policy(name: str) -> Policy:
    """Instantiate the policy registered as ``name`` (or a ``module:attr`` path); validates it."""
    cls = load_plugin(GROUP, name)
    policy = cls()
    if not callable(getattr(policy, "select", None)):
        raise TypeError(f"policy plugin {name!r} has no select() method; installed: {', '.join(available(GROUP))}")
    return policy
