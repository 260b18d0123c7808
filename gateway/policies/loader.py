"""Load policies by name and validate their options at start-up.

A name is an entry point in ``pd_gateway.policies`` (built-ins register the same way) or a
``module:attr`` path. The object must be a class with ``select``. A class that takes options
declares ``Options``, a ``msgspec.Struct`` (``forbid_unknown_fields=True`` recommended): the
gateway's ``--policy-option K=V`` strings are converted to it (``"1.5"`` -> float, ``"true"`` ->
bool) and the policy is built as ``cls(options)``; otherwise as ``cls()``. Every error names the
plugin.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import msgspec

from gateway.policies.base import Policy, PolicyHooks
from workers.plugins import PluginError, available, load_plugin

GROUP = "pd_gateway.policies"
HOOK_NAMES = tuple(name for name in PolicyHooks.__dict__ if name.startswith("on_"))  # (the optional hooks)


class PolicyError(PluginError):
    """A policy plugin cannot be loaded, or its options are wrong."""


def option_names(cls: type) -> frozenset[str]:
    opts = getattr(cls, "Options", None)
    return frozenset(getattr(opts, "__struct_fields__", ())) if opts is not None else frozenset()


def load_policy_class(name: str) -> type:
    obj = load_plugin(GROUP, name)
    if not isinstance(obj, type):
        raise PolicyError(f"policy plugin {name!r} is {obj!r}, not a class")
    if not callable(getattr(obj, "select", None)):
        raise PolicyError(f"policy plugin {name!r} has no select() method; installed: {', '.join(available(GROUP))}")
    if asynchronous := async_members(obj):
        raise PolicyError(f"policy plugin {name!r}: {', '.join(asynchronous)} must be plain functions, not async "
                          "(the gateway calls them synchronously, inside its event loop)")
    opts = getattr(obj, "Options", None)
    if opts is not None and not (isinstance(opts, type) and issubclass(opts, msgspec.Struct)):
        raise PolicyError(f"policy plugin {name!r}: Options must be a msgspec.Struct, got {opts!r}")
    return obj


def async_members(policy: object) -> list[str]:
    """``select`` and the hooks that ``policy`` (a class or an instance) defines as ``async``: none may be."""
    return [name for name in ("select", *HOOK_NAMES)
            if inspect.iscoroutinefunction(fn := getattr(policy, name, None)) or inspect.isasyncgenfunction(fn)]


def create_policy(name: str, options: Mapping[str, str] | None = None) -> Policy:
    """Instantiate the policy registered as ``name`` with validated ``options``."""
    cls = load_policy_class(name)
    opts_type = getattr(cls, "Options", None)
    options = dict(options or {})
    try:
        if opts_type is None:
            if options:
                raise PolicyError(f"policy {name!r} takes no options (got {', '.join(sorted(options))})")
            policy = cls()
        else:
            try:
                parsed = msgspec.convert(options, opts_type, strict=False)
            except msgspec.ValidationError as exc:
                raise PolicyError(f"policy {name!r}: bad option: {exc}") from None
            policy = cls(parsed)
    except PolicyError:
        raise
    except Exception as exc:
        raise PolicyError(f"policy {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
    if not isinstance(getattr(policy, "name", None), str):
        try:
            policy.name = name
        except (AttributeError, TypeError) as exc:  # (e.g. ``__slots__`` without ``name``)
            raise PolicyError(f"policy {name!r} has no str attribute 'name' and cannot be given one: {exc}") from None
    return policy


def parse_option_args(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``K=V`` / ``prefill.K=V`` / ``decode.K=V`` -> {"": {...}, "prefill": {...}, "decode": {...}}."""
    out: dict[str, dict[str, str]] = {"": {}, "prefill": {}, "decode": {}}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PolicyError(f"policy option: expected KEY=VALUE, got {item!r}")
        side, dot, bare = key.partition(".")
        if dot and side in ("prefill", "decode"):
            out[side][bare] = value
        else:
            out[""][key] = value
    return out
