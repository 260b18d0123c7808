"""A worker killed while it creates its shared KV pool (``SharedFile.create``, transfer/shm_files.py) leaves
no file in ``/dev/shm`` for good.

The file is made under a hidden name (``.`` + the name) and renamed into place once locked, sized and mapped.
Reserving a decode's pool (``posix_fallocate`` of gigabytes of tmpfs) takes a while, and it is just when memory
is short that the OOM killer (or an orchestrator's SIGKILL of a worker slow to start) ends the process there.
Before, no sweep ever looked at hidden names: the reserved memory stayed in ``/dev/shm`` until reboot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transfer.shm_files import SharedFile, sweep_stale

pytestmark = pytest.mark.timeout(60)

ROOT = str(Path(__file__).resolve().parents[2])
PREFIX = "pd-kv-crash-"


def _killed_while_allocating(directory: str) -> int:
    """A child that creates a pool and is SIGKILLed while its memory is being reserved; its pid."""
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from transfer import shm_files
        from transfer.shm_files import SharedFile
        real = os.posix_fallocate
        def slow(fd, offset, size):  # a big pool: the reservation takes a while
            real(fd, offset, size)
            print("allocating", flush=True)
            time.sleep(60)
        shm_files.os.posix_fallocate = slow
        SharedFile.create({PREFIX!r}, 1 << 20, {directory!r}, allocate=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "allocating"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.pid


def test_a_pool_killed_while_being_created_is_swept_by_the_next(tmp_path):
    directory = str(tmp_path)
    _killed_while_allocating(directory)
    assert len(os.listdir(directory)) == 1  # its half-made file, 1 MiB reserved
    restarted = SharedFile.create(PREFIX, 4096, directory)  # the worker starts again
    try:
        assert os.listdir(directory) == [os.path.basename(restarted.path)], "the dead worker's file stayed"
    finally:
        restarted.close()
    assert os.listdir(directory) == []


def test_a_live_creators_hidden_file_is_not_swept(tmp_path):
    """The sweep still leaves alone a file whose creator lives (between its ``open`` and ``rename``)."""
    hidden = tmp_path / f".{PREFIX}{os.getpid()}-00000000"
    hidden.write_bytes(b"x")  # (unlocked: as between the creator's open and its flock)
    assert sweep_stale(str(tmp_path), PREFIX) == 0
    assert hidden.exists()


def test_a_file_unlinked_before_its_creator_locked_it_is_made_again(tmp_path, monkeypatch):
    """A sweeper that cannot tell the creator lives (another pid namespace sharing ``/dev/shm``) unlinks the
    hidden file between the creator's ``open`` and its ``flock``: the creator makes another, not a file
    that is already gone (whose rename would fail, or worse, leave a pool nobody else can find)."""
    import fcntl

    from transfer import shm_files

    real_flock = fcntl.flock
    unlinked: list[str] = []

    def sweep_first(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH and not unlinked:
            (name,) = os.listdir(tmp_path)
            os.unlink(tmp_path / name)  # what such a sweep does
            unlinked.append(name)
        real_flock(fd, op)

    monkeypatch.setattr(shm_files.fcntl, "flock", sweep_first)
    made = SharedFile.create(PREFIX, 4096, str(tmp_path))
    monkeypatch.setattr(shm_files.fcntl, "flock", real_flock)
    try:
        assert unlinked and os.listdir(tmp_path) == [os.path.basename(made.path)]
        assert os.fstat(made.fd).st_nlink == 1
    finally:
        made.close()
