"""A request one side of a pair refuses after admission (a grammar the prefill's matcher gives up on at its first
mask) reaches the gateway twice: the refusing side's own 400, naming the client's field, and the other side's relay
of it (``bad_request``, ``Fault.NONE``, "aborted by the prefill: refused the request: ..."), which names none. Each
comes over its own connection, so either may come first: on a real SmolLM2 pair about 4 in 10 clients got
``param: null`` and a message about an internal room. The refusing side's own answer is the client's."""

from __future__ import annotations

import asyncio

import pytest
from test_deadlines import disaggregated, drain, until
from test_hot_path import _sent

from gateway.dispatch import DispatchConfig
from gateway.errors import BadRequest
from workers.protocol import Error, Fault, SamplingParams, Submit

OWN = "regex: the grammar could not be followed: NoExtensionBias"


@pytest.mark.parametrize("refuser", ["prefill", "decode"])
def test_the_refusing_sides_own_error_reaches_the_client_whichever_comes_first(refuser: str) -> None:
    async def main() -> None:
        dispatcher, prefills, p_transports, decodes, d_transports = disaggregated(DispatchConfig(max_retries=2))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=4))))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)) and bool(_sent(p_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        (p_submit,) = _sent(p_transports[0], Submit)
        own = (prefills[0], p_submit.rid) if refuser == "prefill" else (decodes[0], d_submit.rid)
        relay = (decodes[0], d_submit.rid) if refuser == "prefill" else (prefills[0], p_submit.rid)
        relay[0]._dispatch(Error(relay[1], "bad_request", f"aborted: room 123: aborted by the {refuser}: refused the "
                                 f"request: {OWN}", fault=Fault.NONE))
        await asyncio.sleep(0.05)
        own[0]._dispatch(Error(own[1], "bad_request", OWN, param="regex"))
        with pytest.raises(BadRequest) as err:
            await asyncio.wait_for(task, 5)
        assert err.value.param == "regex", err.value.message
        assert err.value.message == f"{refuser} worker: {OWN}"

    asyncio.run(main())


def test_a_relayed_refusal_alone_still_ends_the_request() -> None:
    """The refusing side's own answer never comes (its connection lost it): the relay is the answer, soon."""
    async def main() -> None:
        dispatcher, _prefills, _p_transports, decodes, d_transports = disaggregated(DispatchConfig(max_retries=0))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=4))))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        decodes[0]._dispatch(Error(d_submit.rid, "bad_request", f"aborted by the prefill: refused the request: {OWN}",
                                   fault=Fault.NONE))
        with pytest.raises(BadRequest) as err:
            await asyncio.wait_for(task, 5)
        assert "refused the request" in err.value.message

    asyncio.run(main())
