"""A decode whose wait for a room's KV runs out (``--waiting-timeout-s``: the prefill's queue held the request)
reports it as no worker's fault (``Fault.NONE``: a busy prefill's breaker must not open). The retry must still
go to another prefill when there is one: the one that held the request is the busy one. Before, a Fault.NONE
failure avoided only the worker that reported it (the decode, which was only waiting), and a policy that prefers
the busy prefill (``cache_aware``'s home for the prefix) sent the retry back to it to wait out the same queue."""

from __future__ import annotations

import asyncio

from test_deadlines import First, drain, until
from test_hot_path import _connected_workers, _sent

from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.router import Router
from workers.protocol import Error, Fault, Outputs, SamplingParams, StepOutput, Submit


def test_the_retry_after_a_decodes_kv_wait_ran_out_goes_to_another_prefill() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, p_transports = _connected_workers(loop, "prefill", 2)
        decodes, d_transports = _connected_workers(loop, "decode", 1)
        policy = First()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy),  # type: ignore[arg-type]
                                DispatchConfig(max_retries=1, retry_backoff_s=0.01))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=1))))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (submit,) = _sent(d_transports[0], Submit)
        # (as workers/scheduler.py sends it: transfer/decode.py's BOOTSTRAP failure, ``failure_fault`` NONE)
        decodes[0]._dispatch(Error(submit.rid, "transfer_failed", f"room {submit.bootstrap.room}: no KV from the "
                                   "prefill within 2s (its queue may be long)", fault=Fault.NONE))
        assert await until(lambda: len(_sent(d_transports[0], Submit)) == 2, 5)
        assert len(_sent(p_transports[0], Submit)) == 1, "the retry went back to the prefill whose queue held it"
        (p_retry,) = _sent(p_transports[1], Submit)
        retry = _sent(d_transports[0], Submit)[1]
        prefills[1]._dispatch(Outputs([StepOutput(p_retry.rid, [], "transferred")]))
        decodes[0]._dispatch(Outputs([StepOutput(retry.rid, [65], "length")]))
        assert [t for out in await asyncio.wait_for(task, 5) for t in out.token_ids] == [65]
        # (nobody's failure: neither breaker counts it)
        assert prefills[0].health.breaker.failures == 0 and decodes[0].health.breaker.failures == 0

    asyncio.run(main())
