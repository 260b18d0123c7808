import asyncio

import pytest

from workers.protocol import (
    BootstrapTarget,
    Error,
    Hello,
    Outputs,
    SamplingParams,
    StepOutput,
    Submit,
    gateway_codec,
    read_frame,
    worker_codec,
)


def test_roundtrip_both_directions() -> None:
    to_worker, to_gateway = worker_codec(), gateway_codec()
    sub = Submit(7, [1, 2, 3], SamplingParams(max_new_tokens=9, seed=5), BootstrapTarget("127.0.0.1", 8998, 2**63 - 1))
    frame = to_worker.encode(sub)
    assert to_worker.decode(frame[4:]) == sub
    out = Outputs([StepOutput(7, [4, 5], "length", prompt_tokens=3)])
    assert to_gateway.decode(to_gateway.encode(out)[4:]) == out
    err = Error(7, "bad_request", "nope")
    assert to_gateway.decode(to_gateway.encode(err)[4:]) == err


def test_messages_of_the_other_direction_are_rejected() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        worker_codec().decode(gateway_codec().encode(Error(1, "x", "y"))[4:])
    with pytest.raises(msgspec.ValidationError):
        gateway_codec().decode(worker_codec().encode(Hello(1))[4:])


def test_read_frame_limits_and_eof() -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((10**9).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="exceeds"):
            await read_frame(reader)
        reader = asyncio.StreamReader()
        reader.feed_data(b"\x00\x00")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)

    asyncio.run(run())


# SamplingParams as protocol version 2 knew it: a worker of that version decodes a newer Submit without
# complaint and drops every field it does not know (msgspec ignores unknown fields).
_V2_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                       "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "output_offset")


def test_sampling_fields_an_older_worker_would_drop_bump_the_version() -> None:
    import msgspec

    from workers.protocol import PROTOCOL_VERSION, Grammar

    class V2Sampling(msgspec.Struct, omit_defaults=True):
        max_new_tokens: int = 16
        output_offset: int = 0

    sent = SamplingParams(max_new_tokens=9, grammar=Grammar("json_object"), logit_bias={5: -100.0})
    seen = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=V2Sampling)
    assert seen.max_new_tokens == 9  # the older worker would serve it, unconstrained and unbiased...
    added = [name for name in SamplingParams.__struct_fields__ if name not in _V2_SAMPLING_FIELDS]
    assert added and PROTOCOL_VERSION > 2  # ...so the handshake must refuse to pair them
