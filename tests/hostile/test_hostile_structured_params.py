"""StructuredOutputsParams with a token_trie given as a file path (with and without end_token_id),
through the manager and the Hugging Face GrammarLogitsProcessor."""
import json
import pathlib

import pytest
import torch

from logitgate.integrations.transformers import GrammarLogitsProcessor
from logitgate.structured import RequestStatus, StructuredOutputManager, StructuredOutputsParams

V = 64
PAYLOAD = {"modelId": "m", "descriptors": [{"path": "a", "leaves": [{"name": "x", "tokens": [3, 4]}, {"name": "y", "tokens": [5]}]}]}


@pytest.fixture
def trie_file(tmp_path):
    path = tmp_path / "trie.json"
    path.write_text(json.dumps(PAYLOAD))
    return path


def as_given(path, form, payload):
    return {"str": str(path), "path": pathlib.Path(path), "json": json.dumps(payload), "dict": payload}[form]


@pytest.mark.parametrize("form", ["str", "path", "json", "dict"])
@pytest.mark.parametrize("end_in", ["params", "payload"])
def test_token_trie_from_a_file_compiles_in_the_manager(trie_file, form, end_in):
    payload = PAYLOAD if end_in == "params" else {**PAYLOAD, "end_token_id": 1}
    trie_file.write_text(json.dumps(payload))
    params = StructuredOutputsParams(token_trie=as_given(trie_file, form, payload), end_token_id=1 if end_in == "params" else None)
    with StructuredOutputManager(vocab_size=V) as manager:
        manager.add_request("r", params)
        assert manager.wait("r") is RequestStatus.READY, manager.error("r")
        assert manager.validate_tokens("r", [3, 4, 1]) == [3, 4, 1]
        assert manager.validate_tokens("r", [4]) == []


@pytest.mark.parametrize("form", ["str", "path"])
def test_token_trie_file_in_the_hugging_face_processor(trie_file, form):
    proc = GrammarLogitsProcessor(
        params=StructuredOutputsParams(token_trie=as_given(trie_file, form, PAYLOAD), end_token_id=1), vocab_size=V
    )
    scores = proc(torch.tensor([[9]]), torch.zeros(1, V))  # prompt [9]: nothing generated yet
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [3, 5]


def test_bad_token_trie_sources_are_clear_errors(tmp_path):
    missing = StructuredOutputsParams(token_trie=str(tmp_path / "missing.json"), end_token_id=1)
    with pytest.raises(ValueError, match=r"token_trie payload file '.*missing.json' does not exist"):
        missing.spec
    scalar = tmp_path / "scalar.json"
    scalar.write_text("42")
    with pytest.raises(ValueError, match="must be a JSON object, got int"):
        StructuredOutputsParams(token_trie=scalar, end_token_id=1).spec
    broken = tmp_path / "broken.json"
    broken.write_text('{"modelId": ')
    with StructuredOutputManager(vocab_size=V) as manager:
        manager.add_request("b", StructuredOutputsParams(token_trie=str(broken)))
        assert manager.wait("b") is RequestStatus.FAILED
        assert "broken.json" in manager.error("b") and "is not valid JSON" in manager.error("b")
        manager.add_request("m", StructuredOutputsParams(token_trie=tmp_path / "missing.json"))
        assert manager.wait("m") is RequestStatus.FAILED and "missing.json' does not exist" in manager.error("m")
        manager.add_request("e", StructuredOutputsParams(token_trie={**PAYLOAD, "end_token_id": 1.5}))
        assert manager.wait("e") is RequestStatus.FAILED and "end_token_id" in manager.error("e")
