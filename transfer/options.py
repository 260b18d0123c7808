"""Backend options (``pd-worker --transfer-option KEY=VALUE``): declared per backend, checked at start-up.

Lifecycle:
1. A backend class declares ``OPTIONS``: a tuple of ``Option(name, parse, help)``; ``parse`` turns the
   command-line string into the value the backend uses and raises ``ValueError`` naming what it wants.
2. ``parse_options(backend, given, OPTIONS)`` (the worker calls it through ``registry.check_options``
   before it loads its engine, the backend again in its constructor) answers a dict of parsed values for
   the keys given, or raises ``TransferOptionError`` naming the backend and the option: an unknown key
   (listing the known ones) or a bad value.
3. Values are plain strings on the wire of the CLI; a backend that is constructed in code may also get
   already-parsed values (``parse`` accepts them when they are of the right type).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class TransferOptionError(ValueError):
    """A ``--transfer-option`` the backend does not know or whose value it refuses."""


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    help: str


def parse_options(backend: str, given: Mapping[str, Any] | None, spec: Iterable[Option]) -> dict[str, Any]:
    known = {option.name: option for option in spec}
    parsed: dict[str, Any] = {}
    for key, raw in (given or {}).items():
        option = known.get(key)
        if option is None:
            names = ", ".join(sorted(known)) or "none"
            raise TransferOptionError(
                f"transfer backend {backend!r}: unknown option {key!r} (known options: {names})"
            )
        try:
            parsed[key] = option.parse(raw)
        except (TypeError, ValueError) as exc:
            raise TransferOptionError(f"transfer backend {backend!r}: option {key}={raw!r}: {exc}") from None
    return parsed


def split_pairs(items: Iterable[str]) -> dict[str, str]:
    """``["k=v", ...]`` -> dict; ``ValueError`` for an item without ``=`` or a repeated key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"transfer_option: expected KEY=VALUE, got {item!r}")
        if key in out:
            raise ValueError(f"transfer_option: {key!r} given twice")
        out[key] = value
    return out


# -- parsers -------------------------------------------------------------------------------------
def choice(*values: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = str(raw).strip()
        if text not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return text

    return parse


def positive_int(raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError("must be a positive integer") from None
    if value <= 0 or isinstance(raw, bool):
        raise ValueError("must be a positive integer")
    return value


def non_negative_int(raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError("must be an integer >= 0") from None
    if value < 0 or isinstance(raw, bool):
        raise ValueError("must be an integer >= 0")
    return value


def positive_float(raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError("must be a positive number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive number")
    return value


def positive_float_or_inf(raw: Any) -> float:
    """As ``positive_float``, ``inf`` allowed too (a bound switched off: wait for as long as it takes)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError("must be a positive number or inf") from None
    if not value > 0:  # (NaN refused too)
        raise ValueError("must be a positive number or inf")
    return value


def name_list(raw: Any, *, allowed: Iterable[str] | None = None, what: str = "name") -> list[str]:
    """A comma-separated list of names (``a,b``), none empty; optionally each from ``allowed``."""
    items = [str(x).strip() for x in raw] if isinstance(raw, list | tuple) else str(raw).split(",")
    names = [item.strip() for item in items]
    if not names or any(not name for name in names):
        raise ValueError(f"must be a comma-separated list of {what}s, none empty")
    for name in names:
        if not all(ch.isalnum() or ch in "_-.:^" for ch in name):
            raise ValueError(f"{what} {name!r} has characters other than letters, digits and _-.:^")
    if allowed is not None:
        allowed_set = set(allowed)
        bad = [name for name in names if name.lstrip("^") not in allowed_set]
        if bad:
            raise ValueError(f"unknown {what} {', '.join(bad)} (known: {', '.join(sorted(allowed_set))})")
    return names
