"""``RelayDispatcher`` (the worker's SGLang API): each choice's bootstrap target from the client's fields,
the deadlines taken from the worker's own settings, and a client too slow to read its stream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.api import ClientBootstrap
from gateway.dispatch import SlowClient
from gateway.errors import BadRequest
from workers.config import WorkerConfig
from workers.protocol import SamplingParams, StepOutput
from workers.sglang_api import FIRST_TOKEN_SLACK_S, MAX_ROOM, RelayDispatcher, SGLangAPIConfig


def relay(role: str = "decode", client: Any = None, config: SGLangAPIConfig | None = None) -> RelayDispatcher:
    return RelayDispatcher(client, role, config)  # type: ignore[arg-type]


def targets(bootstrap: ClientBootstrap, choices: int, role: str = "decode") -> list[tuple[str, int | None, int]]:
    out = []
    for choice in range(choices):
        target = relay(role).target(bootstrap, choice)
        assert target is not None
        out.append((target.host, target.port, target.room))
    return out


def test_a_scalar_room_gives_choice_i_room_plus_i() -> None:
    got = targets(ClientBootstrap("10.0.0.2", 8998, MAX_ROOM - 1), 3)
    assert got == [("10.0.0.2", 8998, MAX_ROOM - 1), ("10.0.0.2", 8998, MAX_ROOM), ("10.0.0.2", 8998, 0)]


def test_a_list_gives_each_choice_its_item() -> None:
    got = targets(ClientBootstrap(["a", "b", "c"], [1, None, 3], [70, 50, 60]), 3)
    assert got == [("a", 1, 70), ("b", None, 50), ("c", 3, 60)]


def test_a_short_list_repeats_with_rooms_of_their_own() -> None:
    """SGLang's Rust router sizes the lists to n for a prompt array with n > 1 (4 choices, lists of 2):
    the lists repeat, and no two choices share a room."""
    got = targets(ClientBootstrap(["a", "b"], [1, 2], [100, 500]), 6)
    assert got == [("a", 1, 100), ("b", 2, 500), ("a", 1, 101), ("b", 2, 501), ("a", 1, 102), ("b", 2, 502)]
    assert len({room for *_, room in got}) == 6


def test_an_empty_list_is_a_400_naming_it() -> None:
    with pytest.raises(BadRequest) as err:
        relay().target(ClientBootstrap("h", None, []), 0)
    assert err.value.param == "bootstrap_room"


def test_deadlines_follow_the_workers_settings() -> None:
    cfg = SGLangAPIConfig.of(WorkerConfig(role="decode", bootstrap_timeout_s=600, waiting_timeout_s=900,
                                          transfer_timeout_s=60, http_request_timeout_s=3600))
    assert cfg.first_token_timeout_s == 600 + 900 + 60 + FIRST_TOKEN_SLACK_S  # (the scheduler's own stages)
    assert cfg.request_timeout_s == 3600
    short = SGLangAPIConfig.of(WorkerConfig(role="decode", http_request_timeout_s=20))
    assert short.first_token_timeout_s == 20 and short.request_timeout_s == 20


class _Client:
    """A native connection stand-in: takes the submit, keeps the sink, records aborts."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.submits: list[Any] = []
        self.aborted: list[int] = []

    def submit(self, submit: Any, sink: Any, side: str) -> int:
        self.submits.append(submit)
        self.sink = sink
        return 7

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)


def test_a_client_too_slow_for_its_stream_is_told_so_and_the_generation_stops() -> None:
    """More outputs unread than the sink holds: a 503 ``client_too_slow`` (not a 500), the request aborted."""
    async def main() -> None:
        client = _Client()
        gen = relay("both", client, SGLangAPIConfig(request_timeout_s=123)).generate([1, 2], SamplingParams())
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert client.submits[0].timeout_s == 123
        sink = client.sink
        sink.put_nowait(("self", StepOutput(7, [5])))
        assert (await first).token_ids == [5]
        for i in range(sink.limit + 1):  # the consumer reads nothing meanwhile
            sink.put_nowait(("self", StepOutput(7, [i % 200])))
        with pytest.raises(SlowClient):
            await gen.__anext__()
        assert client.aborted == [7]

    asyncio.run(main())
