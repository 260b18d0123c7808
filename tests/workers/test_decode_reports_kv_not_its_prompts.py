"""A decode over the sim engine (which can check KV rows) logs a room whose imported KV is not its prompt's, and a
room whose prompt KV changed while it decoded (a late write of another room landing in its pages): the room and
its pages, where a chaos run's wrong answer only said which text was wrong. The chaos runner reads those lines
(``chaos_cluster.kv_mismatches``) and counts each as a violation."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from transfer import KVArgs, KVManager, create_backend
from workers.engines.base import EngineOptions
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import BootstrapTarget, SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtests"))  # loadtests is not a package
from chaos_cluster import kv_mismatches

PROMPT = [7 + i for i in range(9)]


class _Child:
    """What ``kv_mismatches`` reads of a chaos child: its name and its log."""

    def __init__(self, text: str) -> None:
        self.name, self.text = "decode0", text

    def log_text(self) -> str:
        return self.text


def _run(caplog: pytest.LogCaptureFixture, prefill_salt: int, corrupt: bool) -> list[str]:
    sides = []
    for role in ("prefill", "decode"):
        engine = SimEngine(EngineOptions(extra={"kv_salt": str(prefill_salt if role == "prefill" else 0)}))
        info = engine.info
        pool = KVPool(num_layers=info.num_layers, num_pages=64, page_size=4, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim)
        engine.bind(pool)
        kv = KVManager(role, KVArgs.from_pool(pool), create_backend("tcp"))
        sched = Scheduler(SchedulerConfig(role, chunk_size=64), engine, pool, lambda msgs: None, kv)
        sched.connect(1)
        sides.append((sched, kv, pool))
    (p, pkv, _), (d, dkv, dpool) = sides
    try:
        host, port = pkv.control_address
        for sched in (d, p):
            sched.submit(1, Submit(1, PROMPT, SamplingParams(max_new_tokens=6), BootstrapTarget(host, port, 7),
                                   timeout_s=60))
        deadline = time.monotonic() + 30
        p.step()  # (admitted: the loop below runs while either side holds requests)
        d.step()
        with caplog.at_level(logging.WARNING, logger="workers.scheduler"):
            while d.reqs or p.reqs:
                assert time.monotonic() < deadline
                p.step()
                running = [r for r in d.reqs.values() if r.stage == "running"]
                if corrupt and running:
                    for buf in dpool.kv_buffers():  # (what a late write of another room would do)
                        buf[running[0].pages[0]].view(np.uint8)[...] ^= 0x5A
                    corrupt = False
                d.step()
                time.sleep(0.001)
        return [r.getMessage() for r in caplog.records if "room 7" in r.getMessage()]
    finally:
        pkv.close()
        dkv.close()


def test_an_import_that_is_not_its_prompts_kv_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    (message,) = _run(caplog, prefill_salt=3, corrupt=False)
    assert "the imported KV is not its prompt's" in message and "pages [" in message
    assert kv_mismatches([_Child(f"INFO other\nWARNING {message}\n")]) == [f"decode0: WARNING {message}"]


def test_prompt_kv_that_changed_while_decoding_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    (message,) = _run(caplog, prefill_salt=0, corrupt=True)
    assert "its prompt's KV changed while it decoded" in message
    assert kv_mismatches([_Child(message)]) == [f"decode0: {message}"]


def test_a_clean_room_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert _run(caplog, prefill_salt=0, corrupt=False) == []
