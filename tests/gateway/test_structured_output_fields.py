"""``grammar_for``'s short path (``_none_set``: one C call when a request sets no structured-output
field) must agree with its full look-up: every field the look-up reads is in ``_FIELDS``, and setting
any of them on any route's request takes the full path."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import structured_output
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateSampling
from gateway.errors import BadRequest


class _Recorder:
    """Not a struct (so the full look-up runs); records every attribute read, all unset."""

    def __init__(self) -> None:
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return None


def test_every_field_the_full_look_up_reads_is_in_the_short_paths_list() -> None:
    recorder = _Recorder()
    assert structured_output.grammar_for(recorder) is None
    assert recorder.read, "the full look-up read nothing: the recorder is not exercising it"
    assert recorder.read <= set(structured_output._FIELDS), recorder.read - set(structured_output._FIELDS)


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest, GenerateSampling],
                         ids=lambda k: k.__name__)
def test_setting_any_field_takes_the_full_path(kind: type) -> None:
    base: dict[str, Any] = {"messages": []} if kind is ChatCompletionRequest else {}
    assert structured_output.grammar_for(kind(**base)) is None
    fields = [name for name in structured_output._FIELDS if name in kind.__struct_fields__]
    assert len(fields) >= 3, fields
    for name in fields:
        request = kind(**base, **{name: 12345})  # (a struct built in code is not validated: a bad value)
        with pytest.raises(BadRequest) as caught:
            structured_output.grammar_for(request)
        assert name in (caught.value.param or ""), (name, caught.value.param)
