"""Find a transfer backend by name: entry points of group ``pd_gateway.transfer`` or ``module:attr``."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from transfer.base import TransferBackend
from transfer.options import TransferOptionError, parse_options

GROUP = "pd_gateway.transfer"
# The built-ins also register as entry points (pyproject.toml); this table lets a source checkout that
# was never pip-installed find them too.
_BUILTIN = {
    "tcp": "transfer.tcp:TcpBackend",
    "fake": "transfer.fake:FakeBackend",
    "mooncake": "transfer.mooncake:MooncakeBackend",
    "nixl": "transfer.nixl:NixlBackend",
    "shm": "transfer.shm:create_shm_backend",
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


def load_backend(name: str) -> Any:
    """The class or factory registered as ``name`` (or ``"module:attr"``), not yet built: its class
    attributes (``OPTIONS``, ``SHARED_POOL``, ``MOVES_BYTES``, ``unavailable_reason()``) describe it."""
    return _load(name)


def wants_shared_pool(name: str) -> bool:
    """Whether a decode using backend ``name`` should keep its KV pool in shared memory (the plugin's
    ``SHARED_POOL``: a co-located prefill then copies into it, ``transfer.shm``)."""
    return bool(getattr(_load(name), "SHARED_POOL", False))


def check_options(name: str, options: Mapping[str, str]) -> None:
    """Start-up check of ``--transfer-option`` values against the backend's ``OPTIONS``, without building
    it: ``TransferOptionError`` names the backend and the option (a backend that declares no ``OPTIONS``
    takes none)."""
    factory = _load(name)
    spec = getattr(factory, "OPTIONS", None)
    if spec is None:
        if options:
            raise TransferOptionError(f"transfer backend {name!r} takes no options (got {', '.join(options)})")
        return
    parse_options(name, options, spec)


def build_backend(
    name: str, *, host: str, advertise_host: str, options: Mapping[str, str] | None = None
) -> TransferBackend:
    """The worker's way to create its backend: ``host`` (bind address) and ``advertise_host`` (what
    peers connect to) go to a backend that accepts them, ``options`` (``--transfer-option``) to one
    with ``OPTIONS``."""
    check_options(name, options or {})
    factory = _load(name)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    kwargs: dict[str, Any] = {}
    for key, value in (("host", host), ("advertise_host", advertise_host)):
        if key in params:
            kwargs[key] = value
    if options:
        kwargs["options"] = dict(options)
    return create_backend(name, **kwargs)
