"""Shared-memory files for the same-host KV path: create, map, find, and sweep after a crash.

Lifecycle of a file this module makes (``SharedFile.create``):
1. Stale files of the same prefix in the directory are swept first: every owner holds a shared
   ``flock`` on its file while it lives, so a file that takes an exclusive ``flock`` has no owner (its
   process died without unlinking it) and is unlinked.
2. The new file (random name, ``O_EXCL``, mode 0600) is made under a hidden name (``.`` + the name,
   which a sweep of the prefix only looks at once the pid in the name is gone: a creator killed before
   the rename), locked, sized and mapped shared, and only then renamed into place, so a worker starting at
   the same moment never sweeps it (a sweeper in another pid namespace might unlink it before it is locked:
   the creator sees it unlinked and makes another); its owner keeps the ``flock`` until ``close``.
3. ``close()`` unlinks the file and closes the descriptor. The mapping itself stays valid (numpy views
   may still point into it); the memory is freed once nothing maps it.

``mapping_of(addr)`` reads ``/proc/self/maps`` to tell whether an address lies in a shared mapping of a
file (the transfer backend offers such memory to a co-located peer without knowing who allocated it).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
from dataclasses import dataclass

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class FileMapping:
    """Where an address lives: ``path`` mapped shared at ``start``..``end`` from file offset ``offset``."""

    path: str
    start: int
    end: int
    offset: int

    def file_offset(self, addr: int) -> int:
        return self.offset + (addr - self.start)


def _creator_lives(hidden_name: str, prefix: str) -> bool:
    """Whether the process named in a hidden (being created) file's name ``.<prefix><pid>-<random>`` lives
    (or may: a name we cannot read, a pid we may not signal)."""
    pid_text = hidden_name[1 + len(prefix):].partition("-")[0]
    if not (pid_text.isascii() and pid_text.isdigit()):  # (not ``int``'s other scripts' digits: a ValueError)
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # (a pid past the C int's range: no process of ours)
        return True
    return True


def sweep_stale(directory: str, prefix: str) -> int:
    """Unlink files named ``prefix*`` in ``directory`` whose owner is gone (no flock held), and hidden ones
    (``.prefix*``: a creator killed before it renamed the file into place) whose creator is gone too. Returns
    how many."""
    swept = 0
    try:
        names = [n for n in os.listdir(directory)
                 if n.startswith(prefix) or (n.startswith(f".{prefix}") and not _creator_lives(n, prefix))]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # its owner lives
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            swept += 1
        os.close(fd)
    return swept


class SharedFile:
    """A file in shared memory, mapped read-write and shared, owned (flocked) by this process."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._closed = False

    @classmethod
    def create(cls, prefix: str, size: int, directory: str | None = None, *, allocate: bool = False) -> SharedFile:
        """A new zero-filled file of ``size`` bytes. ``allocate``: reserve every page now, so that a full
        tmpfs (a container's 64 MiB ``/dev/shm``) fails here with ENOSPC instead of a SIGBUS on first touch.
        Raises OSError when the directory is unusable or too small."""
        if size <= 0:
            raise ValueError(f"shared file size must be positive, got {size}")
        directory = directory or SHM_DIR
        sweep_stale(directory, prefix)
        for _ in range(8):
            name = f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"
            path, hidden = os.path.join(directory, name), os.path.join(directory, f".{name}")
            fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                # a sweeper that took it for a dead creator's (another pid namespace) unlinked it before our
                # lock: make another (with the lock held, no sweep can unlink it any more)
                if os.fstat(fd).st_nlink:
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        else:
            raise OSError(f"shared file {prefix}* in {directory}: unlinked under us again and again")
        made = hidden
        try:
            if allocate:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            shared = cls(path, fd, size)
            os.rename(hidden, path)  # (locked already: a sweep of the prefix sees a live owner)
            made = path
            return shared
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(made)
            raise

    def close(self) -> None:
        """Unlink the file and drop the descriptor (and the flock); existing mappings stay valid."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def check_private(fd: int, path: str) -> None:
    """ValueError unless ``fd`` is a regular file of this process's user that no other user may open (as
    ``SharedFile`` makes them): a file another user could write proves nothing (they could have written the
    nonce), and a peer's offer must not make us map and write a file of theirs, or anything but such a file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path} belongs to uid {st.st_uid}, not ours ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise ValueError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o})")


def mapping_of(addr: int) -> FileMapping | None:
    """The shared file mapping holding ``addr`` in this process, or None (anonymous, private, deleted)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        start_s, _, end_s = fields[0].partition("-")
        start, end = int(start_s, 16), int(end_s, 16)
        if not start <= addr < end:
            continue
        perms, path = fields[1], fields[5].rstrip("\n")
        if "s" not in perms or "w" not in perms or not path.startswith("/") or path.endswith(" (deleted)"):
            return None
        return FileMapping(path, start, end, int(fields[2], 16))
    return None
