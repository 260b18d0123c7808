"""Find a transfer backend by name: entry points of group ``pd_gateway.transfer`` or ``module:attr``."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from transfer.base import TransferBackend

GROUP = "pd_gateway.transfer"
# The built-ins also register as entry points (pyproject.toml); this table lets a source checkout that
# was never pip-installed find them too.
_BUILTIN = {
    "tcp": "transfer.tcp:TcpBackend",
    "fake": "transfer.fake:FakeBackend",
    "mooncake": "transfer.mooncake:MooncakeBackend",
    "nixl": "transfer.nixl:NixlBackend",
}


def available_backends() -> list[str]:
    """Names of every registered backend (not whether its library imports)."""
    return sorted({*_BUILTIN, *(ep.name for ep in entry_points(group=GROUP))})


def _load(name: str) -> Any:
    if ":" in name:
        target = name
    else:
        found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
        if found:
            try:
                return found[0].load()
            except Exception as exc:
                raise ValueError(f"transfer backend plugin {name!r} failed to load: {exc!r}") from exc
        if name not in _BUILTIN:
            raise ValueError(
                f"unknown transfer backend plugin {name!r}; available: {', '.join(available_backends())}"
            )
        target = _BUILTIN[name]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"transfer backend plugin {name!r}: cannot import {module_name}: {exc!r}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"transfer backend plugin {name!r}: {module_name} has no {attr!r}") from exc


def create_backend(name: str, **options: Any) -> TransferBackend:
    """Instantiate the backend registered as ``name`` (or ``"module:attr"``) with ``options``."""
    factory = _load(name)
    if not callable(factory):
        raise ValueError(f"transfer backend plugin {name!r} is not callable: {factory!r}")
    try:
        backend = factory(**options)
    except TypeError as exc:
        raise ValueError(f"transfer backend plugin {name!r}: bad options {sorted(options)}: {exc}") from exc
    if not isinstance(backend, TransferBackend):
        raise ValueError(
            f"transfer backend plugin {name!r} built {type(backend).__name__}, not a TransferBackend"
        )
    return backend
