"""Keys given on a command line: as flags, in files (one key per line, ``#`` comments) or in the environment;
shared by the gateway's and the worker's command lines."""

from __future__ import annotations

import os
from pathlib import Path


def read_keys(path: str | None, flag: str = "api_key_file") -> list[str]:
    """The keys in the file at ``path`` (none when no file is given); a file that holds none is an error."""
    if path is None:
        return []
    try:
        # (UTF-8 whatever the locale; "-sig": a byte-order mark, which some editors write, is not part of the first key)
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:  # (read as "no keys", an empty file would leave what it guards open)
        raise ValueError(f"{flag}: {path} holds no key")
    return keys


def one_key(key: str | None, key_file: str | None, env: str, name: str) -> str | None:
    """One key: the flag's (``--NAME``), the file's (``--NAME-file``, exactly one key), else ``$ENV``'s."""
    if key_file is None:
        return key if key is not None else os.environ.get(env) or None
    if key is not None:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{name}: give {flag} or {flag}-file, not both")
    keys = read_keys(key_file, f"{name}_file")
    if len(keys) != 1:
        raise ValueError(f"{name}_file: needs exactly one key, found {len(keys)}")
    return keys[0]
