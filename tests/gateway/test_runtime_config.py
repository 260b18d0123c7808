"""The gateway's runtime around its workers, over stand-in workers (real asyncio servers speaking the
native frames): which worker its tokenizer comes from, what a tokenizer that cannot be used answers,
the prompt limit as workers come and go, and settings refused at start-up rather than failing every
request later."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.errors import NoWorkers
from gateway.remote_tokenizer import RemoteTokenizerError, fetch_tokenizer
from gateway.runtime import Gateway, GatewayConfig
from workers.protocol import (
    PROTOCOL_VERSION,
    GetTokenizer,
    HelloAck,
    KVEvents,
    LoadReport,
    Ping,
    Pong,
    TokenizerFiles,
    read_frame,
    worker_codec,
)


def tokenizer_files() -> dict[str, bytes]:
    """A tiny real tokenizer (byte-level BPE) as a worker would send it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a tiny corpus"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = json.dumps({"eos_token": "<|end|>"}).encode()
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": config}


class StandIn:
    """A native worker that answers the handshake, probes and ``GetTokenizer`` (or never answers it)."""

    def __init__(self, worker_id: str, *, tokenizer: str = "/models/not-on-this-host", max_context: int = 4096,
                 files: dict[str, bytes] | None = None, answer_files: bool = True, serves_files: bool = True,
                 cached: tuple[bytes, ...] = (), role: str = "both", files_delay_s: float = 0.0,
                 num_pages: int = 256) -> None:
        self.worker_id, self.tokenizer, self.max_context = worker_id, tokenizer, max_context
        self.num_pages = num_pages  # (of 16 tokens)
        self.files, self.answer_files, self.serves_files = files, answer_files, serves_files
        self.role, self.files_delay_s = role, files_delay_s  # (the tokenizer's files sent that much later)
        self.cached = cached  # prefix-cache page hashes it reports to each new connection
        self.asked = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> StandIn:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"pd://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.05)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        codec = worker_codec()
        self.writers.append(writer)
        try:
            await read_frame(reader)  # Hello
            prefill = self.role == "prefill"  # (a prefill names its bootstrap address)
            writer.write(codec.encode(HelloAck(PROTOCOL_VERSION, self.worker_id, self.role, "sim", "m", self.tokenizer,
                                               16, self.max_context, self.num_pages,
                                               tokenizer_files=int(self.serves_files),
                                               bootstrap_host="127.0.0.1" if prefill else None,
                                               bootstrap_port=1 if prefill else None)))
            writer.write(codec.encode(LoadReport(0, 0, 256, 256)))
            if self.cached:
                writer.write(codec.encode(KVEvents(stored=list(self.cached), reset=True)))
            while True:
                message = codec.decode(await read_frame(reader))
                if isinstance(message, Ping):
                    writer.write(codec.encode(Pong(message.nonce)))
                elif isinstance(message, GetTokenizer):
                    self.asked += 1
                    await asyncio.sleep(self.files_delay_s)
                    if self.answer_files and self.files is not None:
                        writer.write(codec.encode(TokenizerFiles(self.tokenizer, self.files)))
                    elif self.files is None:
                        return  # (hangs up: the fetch fails)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def frontend_within(gw: Gateway, timeout_s: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return gw.require_frontend()
        except NoWorkers:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_the_tokenizer_comes_from_a_connected_worker_not_the_first_one_listed(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first worker listed cannot send its tokenizer and then goes away for good: the next request's
    fetch asks the worker that is still there (it asked the gone one for ever)."""
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))

    async def main() -> None:
        gone = await StandIn("a").start()  # (files None: it hangs up when asked)
        there = await StandIn("b", files=tokenizer_files()).start()
        gw = Gateway(GatewayConfig(worker=(gone.url, there.url), startup_timeout_s=5))
        try:
            await gw.start()
            assert gw.frontend is None and gone.asked == 1
            await gone.stop()
            frontend = await frontend_within(gw, 10)
            assert there.asked == 1 and frontend.tokenizer.encode("a tiny")
        finally:
            await gw.aclose()
            await there.stop()

    asyncio.run(main())


def test_a_tokenizer_that_is_nowhere_is_a_503_that_names_it() -> None:
    """A worker names a tokenizer directory that is not on this machine and does not serve its files: no
    crash at start-up and no anonymous 500 per request, but a 503 naming the directory, every time."""
    async def main() -> None:
        worker = await StandIn("a", tokenizer="/nowhere/model", serves_files=False).start()
        gw = Gateway(GatewayConfig(worker=(worker.url,), startup_timeout_s=5))
        try:
            await gw.start()
            for _ in range(2):
                with pytest.raises(NoWorkers, match="cannot load the tokenizer /nowhere/model"):
                    gw.require_frontend()
            assert worker.asked == 0
        finally:
            await gw.aclose()
            await worker.stop()

    asyncio.run(main())


def test_an_unloadable_tokenizer_on_this_machine_is_a_503_naming_it(tmp_path: Path) -> None:
    """The worker's tokenizer directory is here, but its tokenizer.json is not a tokenizer."""
    (tmp_path / "tokenizer.json").write_text("{not json")

    async def main() -> None:
        worker = await StandIn("a", tokenizer=str(tmp_path)).start()
        gw = Gateway(GatewayConfig(worker=(worker.url,), startup_timeout_s=5))
        try:
            await gw.start()  # (no exception: it used to end the gateway with a traceback)
            with pytest.raises(NoWorkers, match=f"cannot load the tokenizer {tmp_path}"):
                gw.require_frontend()
        finally:
            await gw.aclose()
            await worker.stop()

    asyncio.run(main())


def test_a_fetch_that_gets_no_answer_says_so() -> None:
    async def main() -> None:
        worker = await StandIn("a", files={}, answer_files=False).start()
        try:
            with pytest.raises(RemoteTokenizerError, match=r"no answer within 0\.3s"):
                await fetch_tokenizer("127.0.0.1", worker.port, timeout_s=0.3)
        finally:
            await worker.stop()

    asyncio.run(main())


def test_the_context_served_is_the_longest_workers_and_follows_the_workers_there() -> None:
    """A fleet of combined workers with different contexts serves the longest (each request goes to a worker
    it fits: ``_fitting``); the figure follows a worker that comes back with another context, and the admin
    API's removal of the longest."""
    async def main() -> None:
        long = await StandIn("long", tokenizer="byte", max_context=8192).start()
        short = await StandIn("short", tokenizer="byte", max_context=512).start()
        gw = Gateway(GatewayConfig(worker=(short.url,), startup_timeout_s=5, drain_timeout_s=1))
        try:
            await gw.start()
            frontend = gw.require_frontend()
            assert frontend.max_context == 512
            added = gw.add_worker(long.url, "both")
            assert await added.wait_ready(5)
            assert frontend.max_context == 8192
            long.max_context = 2048  # restarted with a shorter context: the connection drops, it reconnects
            for writer in long.writers:
                writer.close()
            for _ in range(100):
                if frontend.max_context == 2048:
                    break
                await asyncio.sleep(0.05)
            assert frontend.max_context == 2048
            gw.remove_worker(long.url)
            for _ in range(100):
                if gw.find(long.url) is None:
                    break
                await asyncio.sleep(0.05)
            assert gw.find(long.url) is None and frontend.max_context == 512
        finally:
            await gw.aclose()
            await long.stop()
            await short.stop()

    asyncio.run(main())


def test_the_default_budget_follows_the_decode_pools_left() -> None:
    """A budget the client did not set is cut to the largest decode pool (``decode_capacity``); once the admin
    API has removed the worker that had it, to the largest of those left."""
    async def main() -> None:
        big = await StandIn("big", tokenizer="byte", num_pages=256).start()
        small = await StandIn("small", tokenizer="byte", num_pages=64).start()
        gw = Gateway(GatewayConfig(worker=(small.url, big.url), startup_timeout_s=5, drain_timeout_s=1))
        try:
            await gw.start()
            assert all([await w.wait_ready(5) for w in gw.decodes])
            assert gw.dispatcher.decode_capacity() == 256 * 16
            gw.remove_worker(big.url)
            for _ in range(100):
                if gw.find(big.url) is None:
                    break
                await asyncio.sleep(0.05)
            assert gw.find(big.url) is None and gw.dispatcher.decode_capacity() == 64 * 16
        finally:
            await gw.aclose()
            await big.stop()
            await small.stop()

    asyncio.run(main())


@pytest.mark.parametrize("flags, needle", [
    (["--default-max-tokens", "0"], "default_max_tokens"),
    (["--request-timeout-s", "0"], "request_timeout_s"),
    (["--first-token-timeout-s", "-1"], "first_token_timeout_s"),
    (["--stream-idle-timeout-s", "0"], "stream_idle_timeout_s"),
    (["--startup-timeout-s", "-1"], "startup_timeout_s"),
    (["--max-body-bytes", "0"], "max_body_bytes"),
    (["--assume-ttl-s", "inf"], "assume_ttl_s"),
    (["--tokenizer", "/nonexistent/model"], "tokenizer"),
])
def test_settings_that_would_fail_every_request_are_refused_at_start_up(flags: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        config_from_args(build_parser().parse_args(["--worker", "pd://127.0.0.1:9", *flags]))


def test_the_settings_refused_above_have_working_neighbours(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = config_from_args(build_parser().parse_args([
        "--worker", "pd://127.0.0.1:9", "--default-max-tokens", "1", "--startup-timeout-s", "0",
        "--assume-ttl-s", "0", "--tokenizer", str(tmp_path)]))
    assert config.startup_timeout_s == 0 and config.assume_ttl_s == 0 and math.isfinite(config.request_timeout_s)


def test_a_url_added_again_keeps_its_prefix_index_when_the_old_connection_closes() -> None:
    """A worker removed through the admin API and added again before its old connection has closed: the
    new connection's snapshot of the worker's prefix cache is the index's now; the old connection's
    close does not drop it (the cache-aware policy would see the worker as holding nothing)."""
    async def main() -> None:
        hashes = (b"h1" * 8, b"h2" * 8, b"h3" * 8)
        worker = await StandIn("w", tokenizer="byte", cached=hashes).start()
        gw = Gateway(GatewayConfig(worker=(worker.url,), startup_timeout_s=5, policy="cache_aware"))
        try:
            await gw.start()
            index, old = gw.router.index, gw.find(worker.url)
            assert old is not None and index.num_pages(worker.url) == 3
            gw.decodes.remove(old)  # (``_drain_worker``: out of the fleet, its connection not closed yet)
            new = gw.add_worker(worker.url, "both")
            assert await new.wait_ready(5)
            assert len(worker.writers) == 2
            await asyncio.sleep(0.1)  # (its snapshot, sent with the handshake, is read)
            await old.aclose("removed by the admin API")
            assert index.num_pages(worker.url) == 3
            await new.aclose("removed")  # (and the last connection's close does drop it)
            assert index.num_pages(worker.url) == 0
        finally:
            await gw.aclose()
            await worker.stop()

    asyncio.run(main())


@pytest.mark.parametrize("url, clean", [("pd://a\nb:5", "pd://ab:5"), ("pd://127.0.0.1\r\n:5", "pd://127.0.0.1:5"),
                                        ("pd://host\t:5", "pd://host:5"), ("127.0.0.1:5\n", "127.0.0.1:5")])
def test_worker_urls_with_control_characters_are_refused(url: str, clean: str) -> None:
    """``urlsplit`` drops tabs and newlines before the host is checked: such a URL was accepted (admin API)
    and went as it is into log lines (a forged line) and metric labels. Without them it is a good URL."""
    from gateway.sglang_fleet import check_http_url
    from gateway.worker_client import parse_worker_url

    with pytest.raises(ValueError, match="must look like"):
        parse_worker_url(url)
    http_url = "http://" + url.removeprefix("pd://")
    with pytest.raises(ValueError, match="must look like"):
        check_http_url(http_url)
    assert parse_worker_url(clean)[1] == 5
    check_http_url("http://" + clean.removeprefix("pd://"))


def test_the_context_of_a_disaggregated_fleet_is_its_longest_pairs() -> None:
    """Disaggregated: the shorter of the longest prefill's and the longest decode's context. A worker whose
    connection is lost still counts (a request only it could take is a 503 while it is away, not a 400)."""
    async def main() -> None:
        prefill = await StandIn("p", tokenizer="byte", max_context=4096, role="prefill").start()
        short = await StandIn("d-short", tokenizer="byte", max_context=512, role="decode").start()
        long = await StandIn("d-long", tokenizer="byte", max_context=8192, role="decode").start()
        gw = Gateway(GatewayConfig(prefill=(prefill.url,), decode=(short.url, long.url), startup_timeout_s=5,
                                   drain_timeout_s=1))
        try:
            await gw.start()
            assert all([await w.wait_ready(5) for w in gw.clients])
            frontend = gw.require_frontend()
            assert frontend.max_context == 4096  # (the prefill's: the long decode's 8192 needs a prefill as long)
            port = long.port
            await long.stop()  # (its listener closed too: the gateway's reconnects fail)
            for _ in range(40):
                if not gw.find(long.url).is_connected:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.05)
            assert not gw.find(long.url).is_connected  # type: ignore[union-attr]
            assert frontend.max_context == 4096
            await long.start(port)
        finally:
            await gw.aclose()
            await prefill.stop()
            await long.stop()
            await short.stop()

    asyncio.run(main())
