"""The table of what logitgate uses of llama-cpp-python beyond its public API: every row resolves
against the pinned version, a renamed one fails constrain() naming its row, and every private name
the integration's source uses is a row."""
import importlib
import re
from pathlib import Path

import llama_cpp
import pytest

from logitgate.integrations.llama_cpp import constrain
from logitgate.integrations.llama_cpp.private_reads import LLM, PRIVATE_READS, TESTED_VERSION, resolve

SOURCE = Path(__file__).resolve().parents[3] / "logitgate" / "integrations" / "llama_cpp"
ROWS = {row.name: row for row in PRIVATE_READS}


def test_every_row_resolves_against_the_pinned_version(llm):
    assert llama_cpp.__version__ == TESTED_VERSION
    for row in PRIVATE_READS:
        obj = resolve(row, llm)
        if row.use == "call":
            assert callable(obj), row.name
        elif row.use == "write":
            assert isinstance(obj, int), row.name
        assert row.why and row.until, row.name


def _remove(row, llm, monkeypatch):
    """Simulate a llama-cpp-python without the row's name (restored by monkeypatch)."""
    owner = llm if row.owner == LLM else importlib.import_module(row.owner)
    *parents, last = row.path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if owner is llm and last not in vars(llm):
        owner = type(llm)
    monkeypatch.delattr(owner, last)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_a_renamed_attribute_fails_constrain_naming_its_row(llm, monkeypatch, name):
    with monkeypatch.context() as patch:
        _remove(ROWS[name], llm, patch)
        with pytest.raises(RuntimeError, match=re.escape(name)) as raised:
            constrain(llm, strings=["Paris"])
        assert TESTED_VERSION in str(raised.value) and ROWS[name].why in str(raised.value)
    assert constrain(llm, strings=["Paris"]).tree is not None  # restored: nothing was left changed


def test_a_renamed_keyword_fails_constrain_naming_it(llm, monkeypatch):
    def init_sampler(top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.0, processors=None):
        raise AssertionError("never called")

    monkeypatch.setattr(llm, "_init_sampler", init_sampler)
    with pytest.raises(RuntimeError, match=r"Llama\._init_sampler .*logits_processor"):
        constrain(llm, strings=["Paris"])


def test_a_written_attribute_must_stay_a_plain_integer(llm, monkeypatch):
    monkeypatch.setattr(llm, "n_tokens", "0")
    with pytest.raises(RuntimeError, match=r"Llama\.n_tokens"):
        constrain(llm, strings=["Paris"])


def test_every_private_name_the_integration_uses_is_a_row():
    """Names used on the Llama (`llm._x`, writes `llm.x = ...`) and llama.cpp C-API bindings
    (`llama_cpp.llama_x`) in the integration's source; and no row names what the source no longer uses."""
    used, text = set(), ""
    for path in sorted(SOURCE.glob("*.py")):
        if path.name == "private_reads.py":
            continue
        source = path.read_text()
        text += source
        used |= {f"{LLM}.{name}" for name in re.findall(r"\bllm\.(_\w+)", source)}
        used |= {f"{LLM}.{name}" for name in re.findall(r"\bllm\.(\w+)\s*=[^=]", source)}
        used |= {f"llama_cpp.{name}" for name in re.findall(r"\bllama_cpp\.(llama_\w+)\(", source)}
    assert used, "the scan found nothing: the patterns no longer match the source"
    assert used - set(ROWS) == set(), f"private names used without a row in private_reads.py: {sorted(used - set(ROWS))}"
    stale = [name for name, row in ROWS.items() if row.path.split(".")[-1] not in text]
    assert stale == [], f"rows the integration no longer uses: {stale}"
