"""Test support: free ports (``gateway.cluster.free_port``), child processes always reaped, sim clusters."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def in_private_netns() -> bool:
    """True inside a network namespace that holds only loopback (where Mooncake may run).

    ``socket.if_nameindex`` asks the kernel about the caller's namespace (``/sys/class/net`` would
    show the namespace sysfs was mounted in).
    """
    try:
        return sorted(name for _, name in socket.if_nameindex()) == ["lo"]
    except OSError:
        return False


def wait_http_ok(url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError) as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s (last: {last})")


@dataclass
class Procs:
    """Child processes started by one test; every one is killed and reaped at teardown."""

    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """``python *args`` in ``cwd`` (default: this repository), its output in ``<tmp>/<name>.log``."""
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd=cwd or ROOT, start_new_session=True)
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        stop_processes(self.procs)


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGCONT + SIGTERM to each live one (a frozen child must be able to die), then reap; SIGKILL after 10 s."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGCONT)
                proc.terminate()
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    role: str
    port: int
    http_port: int

    @property
    def url(self) -> str:
        return f"pd://127.0.0.1:{self.port}"

    def get(self, path: str) -> object:
        import json

        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def health_status(self) -> int:
        """The status of the worker's ``GET /health`` (503 once it is stopping)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code


@dataclass
class SimCluster:
    procs: Procs
    bootstrap_url: str
    prefills: list[Worker]
    decodes: list[Worker]
    gateway_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    def wait_pools_full(self, timeout_s: float = 20.0, *, alive_only: bool = False) -> None:
        wait_pools_full([w for w in self.workers() if not alive_only or w.proc.poll() is None], timeout_s)


def wait_pools_full(workers: list[Worker], timeout_s: float = 20.0) -> None:
    """Every worker's KV pool is back to all pages free (nothing leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [w.get("/load") for w in workers]
        if all(ld["num_free_pages"] == ld["num_total_pages"] for ld in loads):  # type: ignore[index]
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pages not returned: {loads}")
        time.sleep(0.1)


def post_to_pair(prefill_port: int, decode_port: int, path: str, body: dict[str, object],
                 timeout_s: float = 60.0) -> dict[str, httpx.Response]:
    """As SGLang's router drives a PD pair: the same JSON body POSTed to the prefill's and the decode's HTTP
    ports at once; their ``httpx.Response`` by role ("prefill", "decode")."""
    out: dict[str, httpx.Response] = {}

    def post(role: str, port: int) -> None:
        out[role] = httpx.post(f"http://127.0.0.1:{port}/{path}", json=body, timeout=timeout_s)

    threads = [threading.Thread(target=post, args=item) for item in (("prefill", prefill_port),
                                                                      ("decode", decode_port))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def start_worker(procs: Procs, role: str, *extra: str, bootstrap: str | None = None, name: str | None = None,
                 env: dict[str, str] | None = None) -> Worker:
    port, http_port = free_port(), free_port()
    args = ["-m", "workers.cli", "--role", role, "--port", str(port), "--http-port", str(http_port),
            "--log-level", "warning", *extra]
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    proc = procs.start(name or f"{role}-{port}", *args, env=env)
    try:
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 120, proc)
    except Exception as exc:
        raise RuntimeError(f"{role} worker failed to start: {exc}\n{procs.log(name or f'{role}-{port}')}") from exc
    return Worker(proc, role, port, http_port)


def start_bootstrap(procs: Procs, *extra: str) -> str:
    port = free_port()
    proc = procs.start(f"bootstrap-{port}", "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(port), *extra)
    wait_http_ok(f"http://127.0.0.1:{port}/health", 30, proc)
    return f"http://127.0.0.1:{port}"


def start_gateway(procs: Procs, *args: str) -> int:
    port = free_port()
    proc = procs.start(f"gateway-{port}", "-m", "gateway.cli", "--port", str(port), "--log-level", "warning", *args)
    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)  # /health only says the process is up
    return port


@dataclass
class SmolDeployment:
    """SmolLM2 (torch engine) twice: prefill -> decode behind one gateway, one combined worker behind
    another, so a test can check that the split answers what one worker answers."""

    pd_url: str  # http://127.0.0.1:PORT of the PD gateway (no /v1)
    both_url: str
    workers: list[Worker]

    @property
    def pd_v1(self) -> str:
        return f"{self.pd_url}/v1"

    @property
    def both_v1(self) -> str:
        return f"{self.both_url}/v1"


def start_smollm2(procs: Procs, chunk_size: int = 32) -> SmolDeployment:
    from workers.engines.llama.gguf_convert import default_model_dir

    default_model_dir()  # convert once (cached) before the workers race for it
    boot = start_bootstrap(procs)
    common = ("--engine", "torch", "--num-pages", "256", "--chunk-size", str(chunk_size))
    prefill = start_worker(procs, "prefill", *common, bootstrap=boot)
    decode = start_worker(procs, "decode", *common, bootstrap=boot)
    both = start_worker(procs, "both", *common)
    pd_port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
    both_port = start_gateway(procs, "--worker", both.url)
    return SmolDeployment(f"http://127.0.0.1:{pd_port}", f"http://127.0.0.1:{both_port}", [prefill, decode, both])


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ["What is the capital of France?", "Paris is the capital of France.", "hello world, tokens and bytes"] * 20


def tiny_model_with_tokenizer(path: Path) -> None:
    """A random 2-layer llama (vocab 512) with a small byte-level BPE tokenizer and a ChatML template."""
    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = transformers.AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                            max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": _CHATML}))
