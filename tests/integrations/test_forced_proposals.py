"""forced/proposals.py's choice of the last token of a forced string: left out ("drop") where the
engine samples the request's free rows first (sample_first: the draft's bonus row would be a free
state vLLM fills), proposed ("keep") elsewhere."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from logitgate.integrations.vllm.forced import proposals
from logitgate.integrations.vllm.patching import mark_replacement
from logitgate.integrations.vllm.sample_first import scheduler


def _fill(self, *args):
    return None


class _PlainManager:  # vLLM's StructuredOutputManager without sample_first
    grammar_bitmask = _fill


class _SampleFirstManager:  # with sample_first's replacement installed
    grammar_bitmask = mark_replacement(lambda self, *args: None, _fill, "grammar_bitmask")


def _request(**params):
    values = {"logprobs": None, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, **params}
    return SimpleNamespace(sampling_params=SimpleNamespace(**values))


@pytest.mark.parametrize("where,manager,params,rule", [
    ("local", _SampleFirstManager, {}, "drop"),
    ("mirrored", _SampleFirstManager, {"temperature": 1.0}, "drop"),
    (None, _SampleFirstManager, {}, "keep"),  # sample_first off in this engine (a GPU, several workers...)
    ("local", _PlainManager, {}, "keep"),  # sample_first not installed
    ("local", _SampleFirstManager, {"logprobs": 2}, "keep"),  # a row that never samples first
    ("local", _SampleFirstManager, {"temperature": 1.0, "top_p": 0.9}, "keep"),
])
def test_the_last_token_is_left_out_where_free_rows_sample_first(monkeypatch, where, manager, params, rule):
    monkeypatch.setattr(scheduler, "_deferral", lambda manager, state: where)
    monkeypatch.setattr(scheduler, "engine_state", lambda manager: None)
    assert proposals.last_token_rule(manager(), _request(**params)) == rule
