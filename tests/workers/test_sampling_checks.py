"""Optional sampling fields: each engine honours or refuses each one explicitly (``check_sampling``)."""

from __future__ import annotations

import pytest
from test_sim_engine import setup

from workers.engines.base import OPTIONAL_SAMPLING, Engine, SeqInput, SeqOutput, check_sampling
from workers.engines.sim import ALPHABET, SimEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams

SET = {
    "logit_bias": {5: 1.0},
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_new_tokens": 3,
}


class PluginEngine(Engine):
    """A third-party engine that declares no optional sampling field."""

    name = "plugin"
    info = SimEngine().info

    def bind(self, pool: KVPool) -> None:
        pass

    def forward(self, batch: list[SeqInput]) -> list[SeqOutput]:
        return []


class AllEngine(PluginEngine):
    name = "all"
    supported_sampling = frozenset(OPTIONAL_SAMPLING)


def test_every_optional_field_is_in_the_table() -> None:
    assert set(SET) == set(OPTIONAL_SAMPLING)
    assert check_sampling(SamplingParams(), PluginEngine()) is None


@pytest.mark.parametrize("field", list(SET))
def test_sim_refuses_what_needs_logits_and_a_plugin_refuses_everything(field: str) -> None:
    params = SamplingParams(**{field: SET[field]})
    sim = check_sampling(params, SimEngine())
    if field == "min_new_tokens":
        assert sim is None
    else:
        assert sim is not None and sim.startswith(f"{field} is not supported by the sim engine")
    plugin = check_sampling(params, PluginEngine())
    assert plugin is not None and plugin.startswith(f"{field} is not supported by the plugin engine")
    assert check_sampling(params, AllEngine()) is None


@pytest.mark.parametrize(("fields", "named"), [
    ({"logit_bias": {258: 1.0}}, "logit_bias"),  # the sim vocabulary is 258
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    # (min_new_tokens bans them by index: one outside the vocabulary failed the whole batch's step)
    ({"stop_token_ids": [258], "min_new_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [5, -3]}, "stop_token_ids"),
    # (every request carries these; out of range, a batch's sampling step failed on NaN probabilities)
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"top_k": -2}, "top_k"),
])
def test_out_of_range_values_are_refused_by_name(fields: dict, named: str) -> None:
    problem = check_sampling(SamplingParams(**fields), AllEngine())
    assert problem is not None and problem.startswith(named), problem


def test_sim_honours_min_new_tokens() -> None:
    """With every alphabet byte a stop token, the sim still emits min_new_tokens non-stop tokens."""
    engine, pool = setup()
    pages = pool.alloc(8)
    assert pages
    prompt = list(range(40, 50))
    stops = sorted(set(ALPHABET))
    params = SamplingParams(min_new_tokens=4, stop_token_ids=stops)
    (first,) = engine.forward([SeqInput(1, pages, 0, prompt, True, params)])
    outputs = [first.token_id]
    for n in range(1, 6):
        (out,) = engine.forward([SeqInput(1, pages, len(prompt) + n - 1, [outputs[-1]], True, params, n)])
        outputs.append(out.token_id)
    assert not set(outputs[:4]) & set(stops)
    assert set(outputs[4:]) <= set(stops), "past min_new_tokens the sim's own choice comes back"
    # A migrated stream (output_offset) counts its earlier outputs.
    late = SamplingParams(min_new_tokens=4, stop_token_ids=stops, output_offset=4)
    (out,) = engine.forward([SeqInput(2, pages, 0, prompt, True, late)])
    assert out.token_id in stops
