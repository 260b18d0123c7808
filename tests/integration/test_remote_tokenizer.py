"""A gateway with no copy of the model gets the tokenizer and chat template from the worker over the
native protocol (``GetTokenizer`` -> ``TokenizerFiles``), and a worker that predates it is never asked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import openai
import pytest
from pdtest import ROOT, Procs, start_worker, tiny_model_with_tokenizer, wait_http_ok

from gateway.cluster import free_port
from gateway.remote_tokenizer import needs_fetch
from workers.protocol import HelloAck, ToGateway


def test_an_older_worker_is_not_asked() -> None:
    body = msgspec.msgpack.encode({"type": "hello_ack", "version": 2, "worker_id": "w", "role": "both",
                                   "engine": "torch", "model": "m", "tokenizer": "/nowhere", "page_size": 16,
                                   "max_context": 64, "num_pages": 8})
    ack = msgspec.msgpack.decode(body, type=ToGateway)
    assert isinstance(ack, HelloAck) and ack.tokenizer_files == 0 and not needs_fetch(ack.tokenizer, ack)
    assert not needs_fetch("byte", msgspec.structs.replace(ack, tokenizer_files=1))
    assert needs_fetch("/nowhere", msgspec.structs.replace(ack, tokenizer_files=1))


def test_gateway_without_the_model_fetches_the_tokenizer(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the model from the gateway needs a mount namespace (root, unshare)")
    model = tmp_path / "model"
    model.mkdir()
    tiny_model_with_tokenizer(model)
    probe = subprocess.run(["unshare", "--mount", "--", "sh", "-c", f"mount -t tmpfs none {model}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()}")
    procs = Procs(tmp_path)
    try:
        worker = start_worker(procs, "both", "--engine", "torch", "--model", str(model), "--num-pages", "64")
        port = free_port()
        cache = tmp_path / "gateway-cache"
        log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed with the process
        # The gateway sees an empty directory where the model is (its own mount namespace).
        gateway = subprocess.Popen(
            ["unshare", "--mount", "--", "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"', str(model),
             sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", "info",
             "--worker", f"pd://127.0.0.1:{worker.port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PD_GATEWAY_CACHE": str(cache)})
        procs.procs.append(gateway)
        wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, gateway)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model="default", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                             temperature=0)
        (copy,) = (cache / "tokenizers").iterdir()
        assert (copy / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
        assert (copy / "tokenizer_config.json").read_bytes() == (model / "tokenizer_config.json").read_bytes()
        from gateway.hf_tokenizer import HFTokenizer

        expected = HFTokenizer.from_dir(str(model)).apply_chat_template(messages)
        assert out.usage is not None and out.usage.prompt_tokens == len(expected), "the model's own chat template"
        assert "fetched from worker" in (tmp_path / "gateway.log").read_text(errors="replace")
    finally:
        procs.stop_all()
