"""Plugin loading shared by engines, routing policies and transfer backends.

A plugin is named either by an entry point in a group (``pd_gateway.engines``,
``pd_gateway.policies``, ``pd_gateway.transfer``; built-ins register the same way) or by a
``module:attr`` string (the module from ``sys.path``, else from the working directory). Errors name
the plugin and the group.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any


class PluginError(Exception):
    pass


def available(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=group))


def load_plugin(group: str, name: str, base: type | None = None) -> Any:
    """Resolve ``name`` in ``group`` (or a ``module:attr`` path) to the object it names."""
    try:
        if ":" in name:
            module_name, _, attr = name.partition(":")
            obj = getattr(_import(module_name), attr)
        else:
            matches = [ep for ep in entry_points(group=group) if ep.name == name]
            if not matches:
                raise PluginError(f"unknown {group} plugin {name!r}; installed: {', '.join(available(group))}")
            obj = matches[0].load()
    except PluginError:
        raise
    except Exception as exc:  # import errors, missing attributes: name the culprit
        raise PluginError(f"cannot load {group} plugin {name!r}: {exc}") from exc
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginError(f"{group} plugin {name!r} is {obj!r}, not a subclass of {base.__name__}")
    return obj


def _import(module_name: str) -> Any:
    """``module_name`` from ``sys.path``, else from the working directory: an installed console script (``gateway``,
    ``pd-worker``) does not look there, while ``python -m`` and the policy contract's runner do, so a plugin that
    passed its contract run in its project's directory was not found by the gateway started there."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != module_name.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)
